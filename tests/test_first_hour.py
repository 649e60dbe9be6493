"""What a newcomer meets in the first hour: `--version`, `schedule validate` (the help names it), unit costs
labelled as units, a dry run that says when the plain engine cannot fit, and a warm-up that scales with the run."""

from __future__ import annotations

import logging

import pytest
import torch

from stratum.cli import main
from stratum.config import load_config
from stratum.sim.trace import write_chrome_trace
from stratum.train.dryrun import plain_fit
from stratum.train.trainer import read_metrics, train


def test_version(capsys):
    from stratum import __version__
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"stratum {__version__}"


def test_schedule_help_names_only_subcommands_that_exist(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["schedule", "--help"])
    assert "{show,validate,simulate}" in capsys.readouterr().out
    assert main(["schedule", "validate", "--kind", "zb-wave", "--ranks", "2", "--microbatches", "4"]) == 0
    assert "valid:" in capsys.readouterr().out
    path = tmp_path / "s.txt"
    assert main(["schedule", "show", "--kind", "1f1b", "--ranks", "2", "--microbatches", "2",
                 "--save", str(path)]) == 0
    text = path.read_text()
    broken = "\n".join(line for line in text.splitlines() if "B1.1" not in line and "B0.1" not in line)
    path.write_text(broken.replace("F1.1 ", "") if broken != text else text + "\nrank 0: F9.9\n")
    capsys.readouterr()
    assert main(["schedule", "validate", "--file", str(path)]) == 2
    assert "stratum: error:" in capsys.readouterr().err


def test_simulate_labels_unit_costs_as_units_and_profiled_costs_as_seconds(capsys, tmp_path):
    assert main(["schedule", "simulate", "--kind", "1f1b", "--ranks", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "makespan 15 units" in out and "busy units" in out and "peak activation units" in out
    assert " s " not in out and "bytes" not in out

    from stratum.schedule.generators import one_f_one_b
    from stratum.sim.pipeline import Costs, simulate
    seconds = Costs(f=(0.01, 0.01), b=(0.02, 0.02), i=(0.01, 0.01), w=(0.01, 0.01), act_bytes=(1e6, 1e6),
                    out_bytes=(1e3, 1e3))
    text = simulate(one_f_one_b(2, 4), seconds).summary()
    assert "makespan 0.15 s" in text and "busy s" in text and "peak activation bytes" in text
    r = simulate(one_f_one_b(2, 4), Costs.unit(2))
    write_chrome_trace(r, tmp_path / "t.json")
    assert '"time_unit": "units"' in (tmp_path / "t.json").read_text()


def test_dry_run_of_a_model_too_big_for_the_plain_engine_says_so(capsys, monkeypatch):
    import stratum.train.dryrun as dryrun
    monkeypatch.setattr(dryrun, "device_memory_bytes", lambda device: 16 * 10**9)  # a 16 GB machine
    assert main(["train", "--dry-run", "--set", "model.preset='gpt-6.7b'"]) == 0
    out = capsys.readouterr().out
    assert "cannot fit in the 14.90 GiB of RAM available" in out
    assert "--set train.engine=offload --set offload.device_budget=8GB --set offload.host_budget=4GB" in out
    assert main(["train", "--dry-run", "--set", "model.preset='tiny'"]) == 0
    assert "fits in the 14.90 GiB of RAM available" in capsys.readouterr().out
    cpu = torch.device("cpu")
    assert "unknown" in plain_fit(10, None, cpu, "") and "cannot fit" in plain_fit(10, 10, cpu, "")
    # where the disk cannot take what the suggested budgets leave for it, the advice says so
    monkeypatch.setattr(dryrun, "disk_free_bytes", lambda path: 10**9)
    assert "more than the 953.67 MiB free under /some/disk: free space there or set offload.disk_dir" in \
        plain_fit(100 * 10**9, 16 * 10**9, cpu, "/some/disk")
    monkeypatch.setattr(dryrun, "disk_free_bytes", lambda path: 10**12)
    assert "free space there" not in plain_fit(100 * 10**9, 16 * 10**9, cpu, "/some/disk")
    assert dryrun.device_memory_bytes(cpu) > 0  # this Linux machine reports MemAvailable


@pytest.mark.parametrize("steps, fraction, want", [(200, 0.1, 20), (20, 0.1, 2), (5, 0.1, 1), (300, 0.0, 0),
                                                   (20, 0.25, 5)])
def test_warmup_is_a_fraction_of_the_steps_by_default(steps, fraction, want):
    cfg = load_config(None, [f"train.steps={steps}", f"optim.warmup_fraction={fraction}"])
    assert cfg.optim.warmup_steps == -1 and cfg.warmup_steps == want
    assert f"warm-up = {fraction:g} × {steps} steps = {want} steps" in cfg.derived_summary()
    explicit = load_config(None, [f"train.steps={steps}", "optim.warmup_steps=7"])
    longer = f", longer than the run's {steps}: the learning rate never reaches optim.lr" if steps < 7 else ""
    assert explicit.warmup_steps == 7 and f"warm-up = 7 steps (optim.warmup_steps{longer})" in \
        explicit.derived_summary()


@pytest.mark.parametrize("setting", ["optim.warmup_fraction=1.0", "optim.warmup_fraction=-0.1",
                                     "optim.warmup_steps=-2", "train.ckpt_minutes=-1"])
def test_bad_warmup_or_checkpoint_time_is_refused(setting, capsys):
    assert main(["train", "--dry-run", "--set", setting]) == 2
    assert setting.split("=")[0] in capsys.readouterr().err


def test_the_run_uses_the_derived_warmup(make_cfg, caplog):
    caplog.set_level(logging.INFO, logger="stratum")
    cfg = make_cfg("optim.warmup_steps=-1", "optim.warmup_fraction=0.5", "train.steps=6")
    train(cfg, stop_at=5)
    lr = cfg.optim.lr
    lrs = [r["lr"] for r in read_metrics(cfg.train.out_dir)]
    assert lrs[:4] == pytest.approx([lr / 3, 2 * lr / 3, lr, lr]) and lrs[4] < lr  # 3 warm-up steps, decay
    assert "warm-up = 0.5 × 6 steps = 3 steps" in caplog.text
