"""The hardware and plan-search commands: `stratum hardware probe/show`, `stratum plan --parallel`, and
`parallel.plan = "auto"` (the dry run prints the choice and why; a run records prediction beside measurement)."""

from __future__ import annotations

import json
import re

import pytest

from stratum.cli import main
from stratum.config import load_config
from stratum.errors import StratumError
from stratum.ir.hardware import Hardware, Link, dump_hardware, load_hardware
from stratum.offload.tiers import Bandwidths
from stratum.plan import hardware_cli
from stratum.plan.process_probe import ProcessProbe


def _base(corpus_file, cache_dir, out):
    return ["--set", f"data.corpus={str(corpus_file)!r}", "--set", f"data.cache_dir={str(cache_dir)!r}",
            "--set", "model.preset='tiny'", "--set", "data.seq_len=16", "--set", "train.micro_batch_size=2",
            "--set", "train.grad_accum=2", "--set", "train.steps=3", "--set", "train.eval_interval=0",
            "--set", f"train.out_dir={str(out)!r}"]


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text(dump_hardware(Hardware.uniform(2, memory_bytes=2**30, intra=Link(bandwidth=1e9, latency=5e-5))))
    return path


def test_hardware_show_prints_the_spec_and_bad_specs_are_one_line(spec, tmp_path, capsys):
    assert main(["hardware", "show", str(spec)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["rank", "device", "memory", "speed", "node"]
    assert lines[1].split() == ["0", "device", "1.00", "GiB", "1", "0"]
    assert lines[-2].split() == ["intra_node", "1", "GB/s", "50", "us"]
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.read_text().replace("bandwidth = 1000000000.0", "bandwidth = -1"))
    assert main(["hardware", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "intra_node.bandwidth = -1 must be a positive bandwidth" in err


def test_probe_writes_a_spec_from_its_measurements(tmp_path, monkeypatch, capsys):
    # the processes' figures are fixed: rates 10, 10, 5 GFLOP/s together (20 alone here); a 3-rank all-reduce of
    # 8 MiB takes 10 ms and of 4 B 0.1 ms
    seen = {}

    def processes(n, *, threads, sizes, timeout_s):
        seen.update(n=n, threads=threads)
        return ProcessProbe(rates=(10.0, 10.0, 5.0), allreduce_s=(0.01, 0.0001))
    monkeypatch.setattr(hardware_cli, "probe_processes", processes)
    monkeypatch.setattr(hardware_cli, "compute_rate", lambda device: 20.0)
    monkeypatch.setattr(hardware_cli, "usable_cores", lambda: 2)  # 3 processes on 2 cores: one thread each
    monkeypatch.setattr(hardware_cli, "measure_bandwidths", lambda device, disk_dir: Bandwidths(
        h2d=4e9, d2h=3e9, disk_read=2e9, disk_write=1e9, adam_params_per_s=1e8))
    monkeypatch.setattr(hardware_cli.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "probe.toml"
    assert main(["hardware", "probe", "--devices", "3", "--out", str(out), "--disk-dir", str(tmp_path)]) == 0
    hw = load_hardware(out)
    assert seen == {"n": 3, "threads": 1}
    assert [(d.name, d.speed) for d in hw.devices] == [("cpu", 0.5), ("cpu", 0.5), ("cpu", 0.25)]
    assert hw.shared_cores == 2  # the 3 processes share the 2 usable cores
    # T(N) = 2(p-1)/p N/bw + 2(p-1) latency, p = 3
    assert hw.intra_node.latency == pytest.approx(0.0001 / 4) and hw.inter_node == hw.intra_node
    assert hw.intra_node.bandwidth == pytest.approx(4 / 3 * ((8 << 20) - 4) / (0.01 - 0.0001))
    assert hw.host_link.bandwidth == 3e9 and hw.disk_link.bandwidth == 1e9 and hw.disk_bytes > 0
    assert "inter_node: not measured" in out.read_text() and f"wrote {out}" in capsys.readouterr().out


def test_plan_parallel_ranks_the_trees(corpus_file, cache_dir, tmp_path, spec, capsys):
    argv = ["plan", "--parallel", "--devices", "2", "--hardware", str(spec), *_base(corpus_file, cache_dir,
                                                                                     tmp_path / "run")]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    top = lines.index(next(x for x in lines if x.startswith("plan search over 2 devices")))
    assert lines[top + 1].split()[:3] == ["#", "plan", "step"]
    ranked = [x.split()[1] for x in lines[top + 3:] if x.strip()[:1].isdigit()]
    assert {"replicate(2)", "replicate(2,", "pipeline(2,", "split(2)"} == set(ranked)
    assert main(argv[:3] + ["3"] + argv[4:]) == 2
    assert "3 devices asked for (--devices or parallel.devices) but the hardware spec has 2;" in capsys.readouterr().err


def test_auto_dry_run_names_the_choice_and_a_run_records_prediction_beside_measurement(corpus_file, cache_dir,
                                                                                      tmp_path, spec, capsys):
    out = tmp_path / "run"
    auto = ["--set", "parallel.plan='auto'", "--set", f"parallel.hardware={str(spec)!r}"]
    assert main(["train", "--dry-run", *_base(corpus_file, cache_dir, out), *auto,
                 "--set", "parallel.devices=2"]) == 0
    text = capsys.readouterr().out
    assert "parallel.plan = auto: chose " in text and "the fastest predicted step that fits" in text
    assert "plan search over 2 devices" in text and "SIMULATED" in text
    assert not (out / "plan_prediction.json").exists()  # a dry run writes nothing
    # one device: the search's only tree is the plain leaf, trained in this process
    assert main(["train", *_base(corpus_file, cache_dir, out), *auto, "--set", "parallel.devices=1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rec = summary["plan_search"]
    assert rec["plan"] == "local"
    assert rec["predicted_step_s"] > 0 and rec["measured_step_s"] > 0
    assert rec["step_s_error"] == pytest.approx(rec["measured_step_s"] / rec["predicted_step_s"] - 1)
    assert rec["measured_peak_bytes"] == summary["peak_device_bytes"] and rec["predicted_peak_bytes"] > 0
    assert "plan search: step " in capsys.readouterr().out


def test_auto_over_two_processes_trains_the_chosen_tree(corpus_file, cache_dir, tmp_path, capfd):
    """A device too small for the mini GPT's training state, whole or split in two, and for the memory engine
    over the whole model: the trees that fit are the memory engine under split(2) or pipeline(2); the two
    processes train the fastest predicted (given the tree: they do not search again), the prediction beside the
    measurement."""
    spec = tmp_path / "small.toml"
    spec.write_text(dump_hardware(Hardware.uniform(2, memory_bytes=1536 * 2**10, host_bytes=2**33,
                                                   intra=Link(bandwidth=1e9, latency=5e-5))))
    out = tmp_path / "run2"
    assert main(["train", *_base(corpus_file, cache_dir, out), "--set", "model.preset='mini'",
                 "--set", "parallel.plan='auto'", "--set", f"parallel.hardware={str(spec)!r}",
                 "--set", "parallel.devices=2", "--set", f"offload.disk_dir={str(tmp_path)!r}"]) == 0
    text = capfd.readouterr().out  # the ranks' lines too
    assert text.count("plan search over 2 devices") == 1
    leaf = "offload(device_budget=1572864, host_budget=4294967296)"
    assert re.search(rf"replicate\(2, {re.escape(leaf)}\) +cannot run: offload: no placement fits", text)
    # what fits is the memory engine under split(2) or under pipeline(2) (its ranks' in-flight activations
    # recomputed or spilled); the search takes the fastest predicted and the ranks train that tree
    chosen = re.search(r"parallel.plan = auto: chose (.+?) — the fastest predicted step that fits", text)
    assert chosen and chosen[1].startswith(("split(2, ", "pipeline(2, ")) and chosen[1].endswith(f"{leaf})")
    summary = json.loads((out / "summary.json").read_text())
    rec = summary["plan_search"]
    # (the printed tree names a profiled partition "profiled"; the summary keeps the profile's path)
    printed = re.sub(r"partition=[^,]+\.json", "partition=profiled", rec["plan"])
    assert summary["engine"] == rec["plan"] and printed == chosen[1] and summary["steps_done"] == 3
    assert "global batch = 2 (micro) × 2 (accum) × 1 (replicas)" in text and text.count("offload plan:") == 2
    assert 0 < rec["predicted_peak_bytes"] <= 1536 * 2**10 and rec["predicted_step_s"] > 0
    assert rec["measured_step_s"] > 0


def test_auto_is_refused_where_a_tree_is_needed(corpus_file, cache_dir, tmp_path):
    cfg = load_config(None, ["parallel.plan='auto'"])
    with pytest.raises(StratumError, match="chosen by the plan search when `stratum train` starts"):
        _ = cfg.plan
    with pytest.raises(StratumError, match="parallel.devices must be ≥ 0"):
        load_config(None, ["parallel.plan='auto'", "parallel.devices=-1"])
    with pytest.raises(StratumError, match="they go with parallel.plan = 'auto'"):
        load_config(None, ["parallel.devices=2"])
    with pytest.raises(StratumError, match="parallel.hardware = '/nope.toml' is not a file"):
        load_config(None, ["parallel.plan='auto'", "parallel.hardware='/nope.toml'"])


def test_probe_refuses_more_processes_than_the_cores_can_take_before_any_starts(tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr("stratum.plan.process_probe.run_forked", lambda *a, **k: started.append(a))
    assert main(["hardware", "probe", "--devices", "100000", "--out", str(tmp_path / "hw.toml")]) == 2
    err = capsys.readouterr().err
    assert "100,000 local processes on" in err and len(err.strip().splitlines()) == 1
    assert not started and not (tmp_path / "hw.toml").exists()


def test_probe_refuses_a_disk_dir_that_cannot_take_its_files_before_any_starts(tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr("stratum.plan.process_probe.run_forked", lambda *a, **k: started.append(a))
    assert main(["hardware", "probe", "--disk-dir", "/proc", "--out", str(tmp_path / "hw.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stratum: error: --disk-dir '/proc' cannot take the disk probe's files (")
    assert not started and not (tmp_path / "hw.toml").exists()


def test_zero_devices_is_refused_not_taken_for_the_default(capsys):
    assert main(["plan", "--parallel", "--devices", "0", "--set", "model.preset='tiny'"]) == 2
    assert "--devices must be >= 1, got 0" in capsys.readouterr().err


def test_flags_that_would_do_nothing_are_refused(capsys):
    assert main(["plan", "--devices", "2"]) == 2
    assert "--devices and --hardware go with --parallel" in capsys.readouterr().err
    assert main(["plan", "--parallel", "--sweep", "10%"]) == 2
    assert "--sweep, --estimate and --json are the offload plan's" in capsys.readouterr().err


def test_a_resumed_auto_run_keeps_its_tree_and_shares_out_this_commands_micro_batches(tmp_path):
    """The tree is the checkpoints'; train.grad_accum is this command's, shared among the tree's replicas (so a
    changed global batch reaches the resume check, which refuses it as for any plan), never the recorded one."""
    from stratum.plan.search_cli import choose_plan

    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    (out / "checkpoints" / "step_00000002" / "meta.json").write_text("{}")
    (out / "plan_prediction.json").write_text(json.dumps({"plan": "replicate(2)", "grad_accum": 1}))
    sets = ["parallel.plan='auto'", f"train.out_dir={str(out)!r}"]
    for accum, share in ((2, 1), (4, 2)):
        overrides = [*sets, f"train.grad_accum={accum}"]
        got = choose_plan(load_config(None, overrides), None, overrides).config
        assert str(got.plan) == "replicate(2)" and got.train.grad_accum == share
    overrides = [*sets, "train.grad_accum=3"]
    with pytest.raises(StratumError, match=r"^train.grad_accum = 3 does not divide among the 2 replicas of the tree "
                                           r"this run chose before \(replicate\(2\)\)"):
        choose_plan(load_config(None, overrides), None, overrides)


def test_more_devices_than_the_spec_or_the_machine_has_are_refused_before_any_measuring(monkeypatch):
    from stratum.plan import search_cli

    def measured(*a, **k):
        raise AssertionError("measured before the device count was checked")
    monkeypatch.setattr(search_cli, "workload", measured)
    monkeypatch.setattr(search_cli, "_meta_model", measured)
    cfg = load_config(None, [])
    hw = Hardware.uniform(4, memory_bytes=2**30, intra=Link(bandwidth=1e9, latency=1e-5))
    with pytest.raises(StratumError, match="^8 devices asked for .* but the hardware spec has 4"):
        search_cli.plan_search(cfg, 8, hw)
    with pytest.raises(StratumError, match="^100,000 local processes on"):
        search_cli.plan_search(cfg, 100_000, None)


def test_auto_is_read_in_any_case_as_the_plan_nodes_are():
    for text in ("auto", "Auto", " AUTO "):
        cfg = load_config(None, [f"parallel.plan={text!r}", "parallel.devices=2"])
        assert cfg.parallel.auto and cfg.parallel.devices == 2


def test_a_profile_far_off_the_blocks_timed_now_is_measured_again(corpus_file, cache_dir, monkeypatch):
    """Taken under other load, a cached profile's blocks are 50× the step probe's: measured once more."""
    from stratum.ir.costs import StepCosts
    from stratum.plan import search_cli

    cfg = load_config(None, [f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}",
                             "model.preset='tiny'", "data.seq_len=16", "train.micro_batch_size=2"])
    model = search_cli._meta_model(cfg)
    first = search_cli.planning_profile(cfg, model, search_cli.resolve_device("cpu"))  # cached now
    measured, scales = [], iter([0.02, 1.1])
    monkeypatch.setattr(search_cli, "planning_profile", lambda *a: measured.append(a) or first)
    monkeypatch.setattr(search_cli, "step_costs", lambda *a, **k: StepCosts(block_scale=next(scales)))
    work = search_cli.workload(cfg, model, None)
    assert len(measured) == 2 and work.step.block_scale == 1.1
