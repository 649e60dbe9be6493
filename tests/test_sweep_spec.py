"""Sweep files: parsing, grid × random expansion, and one-line errors before any job starts."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from stratum.cli import main
from stratum.errors import StratumError
from stratum.sweep.expand import check_jobs, check_shared_memory, expand, job_config
from stratum.sweep.spec import load_sweep


def write(tmp_path: Path, text: str, name: str = "sweep.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


BASE = """
[model]
preset = "tiny"
[train]
steps = 4
"""


def test_grid_is_the_product_in_file_order_and_ranges_expand(tmp_path):
    p = write(tmp_path, f"""
[sweep]
out_dir = "{tmp_path / 'sw'}"
[sweep.grid]
"optim.lr" = [1e-3, 3e-3]
data.seq_len = {{start = 16, stop = 48, step = 16}}
"optim.min_lr" = {{start = 1e-5, stop = 1e-3, num = 3, log = true}}
{BASE}""")
    spec = load_sweep(p)
    assert spec.grid["data.seq_len"] == [16, 32, 48]
    assert spec.grid["optim.min_lr"] == pytest.approx([1e-5, 1e-4, 1e-3])
    jobs = expand(spec)
    assert len(jobs) == 2 * 3 * 3 and [j.id for j in jobs[:2]] == ["j000", "j001"]
    assert jobs[0].values[:2] == (("optim.lr", 1e-3), ("data.seq_len", 16))
    assert jobs[1].values[1] == ("data.seq_len", 16) and jobs[1].values[2][1] == pytest.approx(1e-4)
    assert jobs[-1].values[0] == ("optim.lr", 3e-3)
    cfg = job_config(spec, jobs[4], tmp_path / "sw")
    assert (cfg.optim.lr, cfg.data.seq_len, cfg.model.preset, cfg.train.steps) == (1e-3, 32, "tiny", 4)
    assert Path(cfg.train.out_dir) == tmp_path / "sw" / "jobs" / "j004"


def test_random_search_is_seeded_and_in_bounds_and_base_file_applies_under_the_sweep_file(tmp_path):
    write(tmp_path, "[train]\nsteps = 9\nmicro_batch_size = 2\n", "base.toml")
    text = f"""
[sweep]
out_dir = "{tmp_path / 'sw'}"
base = "base.toml"
samples = 5
seed = 7
[sweep.grid]
"model.preset" = ["tiny", "mini"]
[sweep.random]
"optim.lr" = {{log_uniform = [1e-4, 1e-2]}}
"train.micro_batch_size" = {{int = [2, 8]}}
"model.dropout" = [0.0, 0.1]
[train]
steps = 3
"""
    spec = load_sweep(write(tmp_path, text))
    jobs = expand(spec)
    assert len(jobs) == 2 * 5
    assert jobs == expand(load_sweep(write(tmp_path, text, "again.toml")))  # same file → same jobs
    for j in jobs:
        v = dict(j.values)
        assert 1e-4 <= v["optim.lr"] <= 1e-2 and 2 <= v["train.micro_batch_size"] <= 8
        assert v["model.dropout"] in (0.0, 0.1)
    assert len({dict(j.values)["optim.lr"] for j in jobs}) == 10
    cfg = job_config(spec, jobs[0], tmp_path / "sw")
    assert cfg.train.steps == 3  # the sweep file's sections override the base file's
    assert cfg.train.micro_batch_size == dict(jobs[0].values)["train.micro_batch_size"]


def test_ranges_end_on_their_stated_values(tmp_path):
    spec = load_sweep(write(tmp_path, """[sweep]
[sweep.grid]
"optim.weight_decay" = {start = 0.0, stop = 0.3, step = 0.1}
"optim.lr" = {start = 1e-3, stop = 1e-2, num = 3, log = true}
"""))
    got = {k: sorted({dict(j.values)[k] for j in expand(spec)}) for k in ("optim.weight_decay", "optim.lr")}
    assert got == {"optim.weight_decay": [0.0, 0.1, 0.2, 0.3], "optim.lr": [0.001, 0.00316227766017, 0.01]}


@pytest.mark.parametrize("body, message", [
    ("[sweep.grid]\n\"optim.lrr\" = [1e-3]", "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("[sweep.grid]\n\"optim.lr\" = []", "optim.lr has an empty list"),
    ("", "[sweep.grid] and [sweep.random] are both empty"),
    ("schedular = \"fifo\"\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "unknown key sweep.schedular"),
    ("scheduler = \"lifo\"\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "sweep.scheduler = 'lifo' is not one of"),
    ("slots = \"2\"\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "sweep.slots must be an integer, got '2'"),
    ("[sweep.grid]\n\"optim.lr\" = [\"fast\"]", "sweep job j000 (lr=fast): optim.lr must be a float"),
    ("[sweep.grid]\n\"train.steps\" = [4, 0]", "j001 (steps=0): train.steps must be ≥ 1"),
    ("[sweep.grid]\n\"train.out_dir\" = [\"a\"]", "train.out_dir cannot be swept"),
    ("[sweep.random]\n\"optim.lr\" = {uniform = [1e-2, 1e-3]}", "uniform needs [low, high] with low ≤ high"),
    ("[sweep.random]\n\"optim.lr\" = {normal = [0, 1]}", "must be a list or one of"),
    ("slots = 100000\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "CPU slots but this machine has"),
    ("devices = [\"cuda:7\"]\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "does not exist"),
    (f"devices = {json.dumps(['cpu'] * ((os.cpu_count() or 1) + 1))}\n[sweep.grid]\n\"optim.lr\" = [1e-3]",
     f"sweep.devices names the CPU {(os.cpu_count() or 1) + 1} times but this machine has"),
    ("early_stop = \"asha\"\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "needs sweep.asha_min_steps ≥ 1"),
    ("[sweep.grid]\n\"train.seed\" = {start = 0, stop = 1e12, step = 1}", "gives 1,000,000,000,001 values"),
    ("samples = 200\n[sweep.grid]\n\"train.seed\" = {start = 0, stop = 99, step = 1}\n[sweep.random]\n"
     "\"optim.lr\" = [1e-3]", "the sweep has 20,000 jobs"),
    ("calibration = 3\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "sweep.calibration must be a string, got 3"),
    ("calibration = \" \"\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "sweep.calibration must be \"off\", \"auto\" or"),
    ("calibration = \"nope.json\"\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "sweep.calibration = 'nope.json': no such"),
    ("grid = \"optim.lr\"", "[sweep.grid] must be a table of section.key = values"),
    ("random = [1e-3, 3e-3]", "[sweep.random] must be a table of section.key = values"),
    ("plan_gap = 1.5\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "sweep.plan_gap must be in [0, 1)"),
    ("[sweep.grid]\n\"optim.lr\" = 1e-3", "optim.lr = 0.001 is one value, not a list or a range; give [0.001]"),
    ("[sweep.grid]\n\"optim.lr\" = [1e-3, 0.001]", "optim.lr lists 0.001 twice"),
    ("devices = \"cpu\"\n[sweep.grid]\n\"optim.lr\" = [1e-3]", "sweep.devices must be a list of strings, e.g. "
     "[\"cuda:0\", \"cuda:1\"]"),
])
def test_bad_sweep_files_are_one_line_errors_that_say_what_to_do(tmp_path, capsys, body, message):
    p = write(tmp_path, f"[sweep]\nout_dir = \"{tmp_path / 'sw'}\"\n{body}\n{BASE}")
    with pytest.raises(StratumError, match=None) as e:
        spec = load_sweep(p)
        check_jobs(spec, expand(spec), tmp_path / "sw")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["sweep", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stratum: error: ") and err.count("\n") == 1
    assert not (tmp_path / "sw").exists()  # nothing written before the sweep is known to be good


def test_asha_rungs_must_be_eval_steps_and_a_changed_sweep_is_refused(tmp_path, corpus_file, cache_dir):
    head = f"""[sweep]
out_dir = "{tmp_path / 'sw'}"
early_stop = "asha"
asha_min_steps = 4
[data]
corpus = "{corpus_file}"
cache_dir = "{cache_dir}"
{BASE.replace("steps = 4", "steps = 8")}
eval_interval = 3
"""
    grid = "[sweep.grid]\n\"optim.lr\" = [1e-3]\n"
    p = write(tmp_path, head + grid)
    assert main(["sweep", "--config", str(p)]) == 2  # rung 4 is not an eval step (every 3)
    from stratum.sweep.runner import open_sweep
    head = head.replace("eval_interval = 3", "eval_interval = 2")
    no_rung = write(tmp_path, head.replace("steps = 8", "steps = 4") + grid, "norung.toml")
    with pytest.raises(StratumError, match=r"^sweep job j000: sweep.asha_min_steps \(4\) is not below its "
                                           r"train.steps \(4\), so asha has no rung"):
        open_sweep(no_rung, say=lambda _: None)
    open_sweep(write(tmp_path, head + grid), say=lambda _: None).state.close()
    other_lr = write(tmp_path, head + grid.replace("1e-3", "2e-3"), "other.toml")
    with pytest.raises(StratumError, match="job j000's optim.lr was 0.001, is now 0.002"):
        open_sweep(other_lr, say=lambda _: None)
    other_steps = write(tmp_path, head.replace("steps = 8", "steps = 6") + grid, "steps.toml")  # (its own section)
    with pytest.raises(StratumError, match=r"job j000's train.steps was 8, is now 6 \(the sweep file or its"):
        open_sweep(other_steps, say=lambda _: None)
    more = write(tmp_path, head + grid.replace("[1e-3]", "[1e-3, 2e-3]"), "more.toml")
    with pytest.raises(StratumError, match="holds another sweep"):  # (a job more: no setting of j000 differs)
        open_sweep(more, say=lambda _: None)


def two_jobs(tmp_path: Path, corpus_file: Path, cache_dir: Path) -> Path:
    """A sweep file of two jobs (two learning rates) on the test corpus."""
    return write(tmp_path, f"""[sweep]
out_dir = "{tmp_path / 'sw'}"
[data]
corpus = "{corpus_file}"
cache_dir = "{cache_dir}"
{BASE}
[sweep.grid]
"optim.lr" = [1e-3, 2e-3]
""")


def test_a_damaged_state_is_named_as_damaged_not_unwritable(tmp_path, corpus_file, cache_dir):
    from stratum.sweep.runner import open_sweep
    p = two_jobs(tmp_path, corpus_file, cache_dir)
    open_sweep(p, say=lambda _: None).state.close()
    db = tmp_path / "sw" / "state.db"
    db.write_bytes(db.read_bytes()[:5000])
    with pytest.raises(StratumError, match=r"state.db is damaged \(.*\); restore it from a copy, or remove it"):
        open_sweep(p, say=lambda _: None)


def test_status_of_a_directory_without_a_sweep_is_an_error(tmp_path, capsys):
    assert main(["sweep", "status", str(tmp_path)]) == 2
    assert "holds no sweep" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    # a state.db that is not a sweep's (not a database; another program's database) is read, not written
    (tmp_path / "state.db").write_bytes(b"not a database")
    assert main(["sweep", "status", str(tmp_path)]) == 2
    assert "is not a sweep's state" in capsys.readouterr().err
    (tmp_path / "state.db").unlink()
    other = sqlite3.connect(tmp_path / "state.db")
    other.execute("CREATE TABLE notes (text TEXT)")
    other.commit()
    other.close()
    before = (tmp_path / "state.db").read_bytes()
    assert main(["sweep", "status", str(tmp_path)]) == 2
    assert "no jobs table" in capsys.readouterr().err and (tmp_path / "state.db").read_bytes() == before


def test_simulate_prints_every_scheduler_labelled_and_writes_no_sweep(tmp_path, corpus_file, cache_dir, capsys):
    p = write(tmp_path, f"""[sweep]
out_dir = "{tmp_path / 'sw'}"
slots = 2
[sweep.grid]
"train.steps" = [2, 3, 6]
[data]
corpus = "{corpus_file}"
cache_dir = "{cache_dir}"
seq_len = 16
{BASE}""")
    assert main(["sweep", "simulate", "--config", str(p), "--png", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SIMULATED: 3 jobs on 2 slot(s), profiled forward+backward times (lrtf in slices of 1 "
                          "steps: sweep.segment_steps is unset, a quarter of the shortest job's steps)")
    assert "sweep.device_budget is unset; a real sharded-lrtf sweep needs one" in out  # (what it assumed)
    lines = {ln.split()[0]: ln for ln in out.splitlines() if " makespan " in ln}
    assert set(lines) == {"fifo", "lrtf", "sharded-lrtf", "planned"}
    # fifo runs the 6-step job last (2 | 3, then 6): 8 step-times; lrtf, sharded-lrtf and planned start it
    # first: 6
    assert "1.33x" in lines["planned"] and "1.00x" in lines["fifo"] and "1.33x" in lines["sharded-lrtf"]
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "sw").exists()
    assert main(["sweep", "--config", str(p), "--png", str(tmp_path / "h.png")]) == 2  # (a run's flag it is not)
    assert "--png is `stratum sweep simulate`'s" in capsys.readouterr().err and not (tmp_path / "sw").exists()


PLAIN_CAL = {"fixed_s": 1.0, "fixed_s_per_byte": 0.0, "step_scale": 1.0, "step_overhead_s": 0.0, "contention": 1.0}


@pytest.mark.parametrize("scheduler, text, message", [
    ("lrtf", "{not json", "is not a plain calibration file (Expecting property name"),
    ("lrtf", "[" * 100_000 + "]" * 100_000, "is not a plain calibration file (maximum recursion depth exceeded"),
    ("lrtf", json.dumps({"calibration": {**PLAIN_CAL, "contention": "high"}}), "contention is not a finite number"),
    ("planned", json.dumps({"calibration": {"fixed_s": 1.0}}), "must have exactly the fields"),
    ("planned", json.dumps({"calibration": PLAIN_CAL, "shapes": {}}), "its \"kind\" must be \"plain\" or"),
    ("planned", json.dumps({"kind": "plain", "calibration": PLAIN_CAL}), "has no \"shapes\" table"),
    ("sharded-lrtf", json.dumps({"kind": "plain", "calibration": PLAIN_CAL, "shapes": {}}),
     "it holds a plain calibration; the scheduler reads a sharded-lrtf one"),
    ("sharded-lrtf", json.dumps({"kind": "sharded-lrtf", "calibration": PLAIN_CAL,
                                 "shapes": {"s": {"label": "x", "fixed_s": 1.0}}}),
     "its shape 's' needs label (text), fixed_s and step_s"),
    ("lrtf", json.dumps({"kind": "plain", "calibration": PLAIN_CAL, "shapes": {}, "alone": [1]}),
     "its \"alone\" is not a table"),
    ("sharded-lrtf", json.dumps({"kind": "sharded-lrtf", "calibration": PLAIN_CAL, "shapes": {},
                                 "give_back": {"s": -0.1}}), "its \"give_back\" must map shapes to seconds"),
])
def test_a_calibration_file_that_holds_none_is_a_one_line_error_before_anything_is_written(
        tmp_path, capsys, scheduler, text, message):
    (tmp_path / "cal.json").write_text(text)
    extra = "segment_steps = 1\n" if scheduler == "lrtf" else "device_budget = \"1MB\"\n" * (scheduler != "planned")
    p = write(tmp_path, f"[sweep]\nout_dir = \"{tmp_path / 'sw'}\"\nscheduler = \"{scheduler}\"\n{extra}"
                        f"calibration = \"cal.json\"\n[sweep.grid]\n\"optim.lr\" = [1e-3]\n{BASE}")
    assert main(["sweep", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stratum: error: sweep.calibration: {tmp_path / 'cal.json'} is not a") and message in err
    assert err.count("\n") == 1 and not (tmp_path / "sw").exists()


def test_a_gpu_must_hold_its_running_jobs_and_a_staged_one_under_sharded_lrtf():
    """(k + 1) × sweep.device_budget on a GPU of k slots: one line naming the device and the budget that fits."""
    gib = 2**30
    check_shared_memory(["cuda:0", "cuda:0", "cuda:1"], 10 * gib, lambda d: 40 * gib)  # 30 and 20 GiB: fit
    check_shared_memory(["cpu", "cpu"], 100 * gib, lambda d: None)  # (no limit: the CPU without device_memory)
    with pytest.raises(StratumError) as e:
        check_shared_memory(["cuda:0", "cuda:0", "cuda:1"], 16 * gib, lambda d: 40 * gib)
    assert "on cuda:0 and one staged need 48.00 GiB, but cuda:0 may hold 40.00 GiB" in str(e.value), str(e.value)
    assert "≤ 13.33 GiB" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("memory", "message"), [
    ("lots", "sweep.device_memory = 'lots' is not a size"),
    ("2MB", "2 running job(s) on cpu and one staged need 2.86 MiB, but cpu may hold 1.91 MiB"),
])
def test_device_memory_must_be_a_size_that_holds_the_slots_and_one_staged_job(tmp_path, memory, message):
    p = write(tmp_path, f"""
[sweep]
scheduler = "sharded-lrtf"
device_budget = "1MB"
device_memory = "{memory}"
slots = 2
devices = ["cpu", "cpu"]
[sweep.grid]
"optim.lr" = [1e-3]
{BASE}""")
    with pytest.raises(StratumError) as e:
        spec = load_sweep(p)
        check_jobs(spec, expand(spec), tmp_path / "sw")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_job_whose_state_cannot_fit_its_device_is_refused_before_any_job(tmp_path, corpus_file, cache_dir,
                                                                            monkeypatch):
    from stratum.sweep.runner import open_sweep
    from stratum.train import fit
    monkeypatch.setattr(fit, "device_memory_bytes", lambda device: 1_000_000)  # room for the batches, not the state
    p = two_jobs(tmp_path, corpus_file, cache_dir)
    with pytest.raises(StratumError, match=r"^sweep job j000 \(lr=0.001\): the training state"):
        open_sweep(p, say=lambda _: None)
    from stratum.sweep.state import SweepState
    state = SweepState(tmp_path / "sw")
    assert state.jobs() == []  # nothing recorded: the corrected file runs in the same directory
    state.close()
