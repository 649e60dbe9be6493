"""TensorBoard and Weights & Biases beside metrics.jsonl: every record's numbers at its step, one stream across
resumes, and a missing package refused before the run starts."""

from __future__ import annotations

import importlib.machinery
import shutil
import sys
import types

import pytest

from stratum.errors import StratumError
from stratum.train.checkpoint import CKPT_DIR
from stratum.train.scalars import TENSORBOARD_DIR, WANDB_ID_FILE, TensorBoardSink, scalars
from stratum.train.trainer import read_metrics, train

from test_hardening import _fill, full_fs  # noqa: F401 (a small real filesystem, full)

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_events(out_dir) -> dict[str, list[tuple[int, float]]]:
    """tag → [(step, value)] as TensorBoard shows them (purged events left out)."""
    acc = event_accumulator.EventAccumulator(str(out_dir / TENSORBOARD_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_every_metric_at_its_step(make_cfg, tmp_path):
    out = tmp_path / "run"
    train(make_cfg("train.tensorboard=true", "train.steps=4", out=out))
    events, records = read_events(out), read_metrics(out)
    assert [s for s, _ in events["train/loss"]] == [1, 2, 3, 4]
    for rec in records:
        for tag, value in scalars(rec).items():
            assert dict(events[tag])[rec["step"]] == pytest.approx(value, rel=1e-6), tag
    assert [s for s, _ in events["eval/loss"]] == [4] and "perf/tokens_per_s" in events


def test_a_resume_purges_the_events_past_its_checkpoint(make_cfg, tmp_path):
    out = tmp_path / "run"
    train(make_cfg("train.tensorboard=true", "train.steps=4", "train.ckpt_interval=2", out=out), stop_at=3)
    # as after a kill between the checkpoints at steps 2 and 3: step 3's events exist, its checkpoint does not
    shutil.rmtree(out / CKPT_DIR / "step_00000003")
    (out / CKPT_DIR / "latest").write_text("step_00000002\n")
    train(make_cfg("train.tensorboard=true", "train.steps=4", "train.ckpt_interval=2", out=out))
    events, records = read_events(out), read_metrics(out)
    assert [s for s, _ in events["train/loss"]] == [1, 2, 3, 4]
    assert [v for _, v in events["train/loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def _fake_wandb(calls: list) -> types.ModuleType:
    """A stand-in for the wandb package that records what Stratum asks of it."""
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()
    wandb.init = init
    wandb.util = types.SimpleNamespace(generate_id=lambda: f"id{len(calls)}")
    return wandb


def test_wandb_gets_every_record_and_a_resume_continues_its_run(make_cfg, tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    out = tmp_path / "run"
    train(make_cfg("train.wandb_project='proj'", "train.steps=3", out=out), stop_at=2)
    train(make_cfg("train.wandb_project='proj'", "train.steps=3", out=out))
    inits = [c[1] for c in calls if c[0] == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] == (out / WANDB_ID_FILE).read_text().strip()
    assert inits[0]["project"] == "proj" and inits[0]["resume"] == "allow"
    assert inits[0]["config"]["train"]["wandb_project"] == "proj"
    logged = [(c[1], c[2]) for c in calls if c[0] == "log"]
    assert [s for s, _ in logged] == [1, 2, 3]
    assert [d["train/loss"] for _, d in logged] == [r["loss"] for r in read_metrics(out)]
    assert sum(c[0] == "finish" for c in calls) == 2


@pytest.mark.parametrize("key, package", [("train.tensorboard=true", "tensorboard"),
                                          ("train.wandb_project='p'", "wandb")])
def test_a_missing_package_is_refused_before_the_run(make_cfg, tmp_path, monkeypatch, key, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes the package look uninstalled
    with pytest.raises(StratumError, match=rf"pip install 'stratum\[{package}\]'"):
        make_cfg(key, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_disk_that_fills_stops_the_events_with_one_line(tmp_path, full_fs, capfd):  # noqa: F811
    (full_fs / "filler").unlink()  # room to open the event file, then none for the steps
    sink = TensorBoardSink(full_fs / TENSORBOARD_DIR, resume_step=0)
    _fill(full_fs)
    with pytest.raises(StratumError, match="cannot write TensorBoard events to .* free space") as e:
        for step in range(1, 10_000):
            sink.write({"step": step, "loss": 1.0})
    assert "\n" not in str(e.value)
    assert capfd.readouterr().err == ""  # no writer thread printing a traceback
