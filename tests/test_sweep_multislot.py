"""The planned scheduler's strategies over several slots, run for real: a job the plan gives replicate(2) or
pipeline(2) runs as one multi-process `stratum train` of that plan on two slots, and its losses equal the same
job.toml run alone and — within the Plan tree's 1e-5 — the plain one-slot run; a killed rank fails the attempt,
which is retried from its checkpoint."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import pytest
from cli_in_process import run_main

from stratum.config import load_config
from stratum.errors import StratumError
from stratum.ir.hardware import Hardware
from stratum.sweep.gang import plan_jobs
from stratum.sweep.gang_plan import Option
from stratum.sweep.job_strategy import options_of
from stratum.sweep.launched import rank_devices
from stratum.sweep.makespan import plan_makespan
from stratum.sweep.runner import run_sweep
from stratum.sweep.schedulers import Planned, Start
from stratum.sweep.spec import load_sweep
from stratum.sweep.state import SweepState
from stratum.sweep.strategies import plan_overrides, relative_options, sweep_plans
from stratum.train.trainer import read_metrics

from test_sweep_gang import _profile
from test_sweep_run import job_losses, kill_midway, rows, standalone_losses, sweep_file, sweep_process


# ---- planning (no processes) ----------------------------------------------------------------------------------
def test_planned_starts_a_two_slot_strategy_on_both_free_slots():
    opts = {"a": {"local": Option(seconds=10.0), "replicate(2)": Option(seconds=4.0, devices=2)}}
    policy = Planned(lambda j: opts[j], 2, time_limit_s=5)
    assert policy.starts([0, 1], ["a"], {}, 0.0) == [Start(job="a", slots=(0, 1), strategy="replicate(2)")]


def test_planned_holds_a_free_slot_for_a_two_slot_job_when_that_ends_sooner():
    # slot 1 is busy for 1 s more: replicate(2) at t=1 ends at 5, local now on slot 0 at 10 — the plan waits
    opts = {"a": {"local": Option(seconds=10.0), "replicate(2)": Option(seconds=4.0, devices=2)}}
    policy = Planned(lambda j: opts[j], 2, time_limit_s=5)
    assert policy.starts([0], ["a"], {1: ("b", 1.0)}, 0.0) == []
    assert policy.plans[-1].placed["a"].strategy == "replicate(2)" and policy.plans[-1].placed["a"].start == 1.0
    # once slot 1 is free the plan starts it on both
    assert policy.starts([0, 1], ["a"], {}, 1.0)[0].slots == (0, 1)


def test_planned_starts_from_an_adopted_plan_without_solving_again():
    """The sweep's predicted makespan made the first plan: the policy follows it while the pending jobs are the
    ones it was made over, and plans anew once they differ."""
    opts = {"a": {"local": Option(seconds=10.0), "replicate(2)": Option(seconds=4.0, devices=2)},
            "b": {"local": Option(seconds=3.0)}}
    made = plan_jobs(opts, [0.0, 0.0], time_limit_s=5)
    policy = Planned(lambda j: opts[j], 2, time_limit_s=5)
    policy.adopt(made, ["a", "b"])
    first = policy.starts([0, 1], ["a", "b"], {}, 0.0)
    assert policy.plans == [made] and first
    assert {st.job for st in first} == {j for j, p in made.placed.items() if p.start == 0.0}
    other = Planned(lambda j: opts[j], 2, time_limit_s=5)
    other.adopt(made, ["a", "b"])
    other.starts([0, 1], ["b"], {}, 0.0)  # (a started elsewhere: not the plan's jobs)
    assert len(other.plans) == 2 and set(other.plans[-1].placed) == {"b"}


def test_one_slot_options_are_planned_by_the_assignment_milp():
    opts = {j: {"local": Option(seconds=t)} for j, t in {"a": 3.0, "b": 2.0, "c": 2.0, "d": 1.0}.items()}
    plan = plan_jobs(opts, [0.0, 0.5], time_limit_s=5)
    flat = plan_makespan({j: {"local": o["local"].seconds} for j, o in opts.items()}, [0.0, 0.5], time_limit_s=5)
    assert plan.makespan == pytest.approx(flat.makespan) == 4.5  # {a, d} | 0.5 + {b, c}
    for j, p in plan.placed.items():  # each job on the assignment's slot, the slot's queue back to back
        assert p.slots == (flat.choices[j].slot,) and p.end - p.start == pytest.approx(opts[j]["local"].seconds)


def test_relative_options_price_plans_against_local_and_drop_what_cannot_help(tmp_path):
    hw = Hardware.uniform(2, memory_bytes=10**9)
    two = load_config(None, ["train.grad_accum=2"])
    opts = relative_options(_profile(1e-3, 4000, 1000, blocks=4), two, ["local", "replicate(2)", "pipeline(2)"], hw)
    assert opts["local"] == Option(seconds=1.0, devices=1)
    assert opts["replicate(2)"].devices == 2 and 0.4 < opts["replicate(2)"].seconds < 1.0
    one = load_config(None, [])  # one micro-batch: no replicas to share it, a pipeline of it has no overlap
    assert set(relative_options(_profile(1e-3, 4000, 1000, blocks=4), one, ["local", "replicate(2)", "pipeline(2)"], hw)) == {"local"}


def test_options_add_a_multi_process_start_up_per_segment_left(tmp_path):
    state = SweepState(tmp_path)
    state.add_jobs([("a", 0, "a", 4)])
    cands = {"a": {"local": Option(seconds=1.0), "replicate(2)": Option(seconds=0.5, devices=2)}}
    whole = options_of(cands, state, {}, lambda j: {"plain": 10.0}, lambda j: 1.0, {2: 3.0}, 0)("a")
    assert whole == {"local": Option(seconds=10.0), "replicate(2)": Option(seconds=8.0, devices=2)}
    sliced = options_of(cands, state, {}, lambda j: {"plain": 10.0}, lambda j: 1.0, {2: 3.0}, 2)("a")  # 2 segments
    assert sliced["replicate(2)"].seconds == 11.0 and sliced["local"].seconds == 10.0
    # the job alone takes 0.6 of its time beside others: a plan holding both slots is priced from that
    alone = options_of(cands, state, {}, lambda j: {"plain": 10.0}, lambda j: 0.6, {2: 3.0}, 0)("a")
    assert alone == {"local": Option(seconds=10.0), "replicate(2)": Option(seconds=0.5 * 6.0 + 3.0, devices=2)}


def test_plan_overrides_keep_the_global_batch():
    cfg = load_config(None, ["train.grad_accum=4"])
    assert plan_overrides("replicate(2)", cfg, 1) == ["parallel.plan='replicate(2)'", "train.grad_accum=2",
                                                      "train.threads=1"]
    assert plan_overrides("pipeline(2)", cfg, 1)[1] == "train.grad_accum=4"
    assert plan_overrides("local", cfg, 1) == []
    with pytest.raises(StratumError, match="do not divide"):
        plan_overrides("replicate(3)", cfg, 1)


@pytest.mark.parametrize("sweep, match", [
    ('scheduler = "planned"\nplans = ["pipeline(2)"]\ndevices = ["cpu", "cuda:0"]', "mixes cpu and cuda"),
    ('scheduler = "planned"\nplans = ["replicate(2)"]\nslice_by = "pause"\nsegment_steps = 2', "cannot be paused"),
    ('scheduler = "planned"\nplans = ["split(2)"]', "is not"),
    ('scheduler = "planned"\nplans = ["replicate(3)"]', "2 ≤ k ≤ sweep.slots"),
    ('plans = ["local"]', "read by scheduler"),
])
def test_bad_sweep_plans_are_one_line_errors(tmp_path, corpus_file, cache_dir, sweep, match):
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep=sweep, grid='"optim.lr" = [1e-3]', steps=2)
    with pytest.raises(StratumError, match=match) as e:
        load_sweep(path)
    assert "\n" not in str(e.value)


def test_default_plans_span_slots_on_cpu_devices_only(tmp_path, corpus_file, cache_dir):
    for devices, multi in (("", True), ('devices = ["cpu", "cpu"]', True), ('devices = ["cuda:0", "cuda:1"]', False)):
        path = sweep_file(tmp_path, corpus_file, cache_dir, sweep=f'scheduler = "planned"\n{devices}',
                          grid='"optim.lr" = [1e-3]', steps=2)
        plans = sweep_plans(load_sweep(path).settings)
        assert ("replicate(2)" in plans and "pipeline(2)" in plans) == multi and "local" in plans, (devices, plans)


def test_a_job_over_device_slots_gets_them_in_rank_order():
    assert rank_devices(("cpu", "cpu"), None) == (["train.device='cpu'"], {})
    # rank r's cuda:LOCAL_RANK is its slot's GPU: the slots' GPUs made visible in rank order
    assert rank_devices(("cuda:1", "cuda:0"), None) == (["train.device='cuda'"], {"CUDA_VISIBLE_DEVICES": "1,0"})
    # through the sweep's own visible devices: its cuda:N is the N-th of them
    assert rank_devices(("cuda:2", "cuda:3"), "4,5,6,7")[1] == {"CUDA_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(StratumError, match="mixes device kinds"):
        rank_devices(("cpu", "cuda:0"), None)


# ---- real runs ------------------------------------------------------------------------------------------------
def train_alone(job_toml: Path, out: Path) -> list[float]:
    """`stratum train --config jobs/<id>/job.toml` as a person repeats the job (its out_dir moved), run in this
    process (cli_in_process.py)."""
    code, printed = run_main(["train", "--config", str(job_toml), "--set", f"train.out_dir={str(out)!r}"])
    assert code == 0, printed
    return [r["loss"] for r in read_metrics(out)]


def close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b))


@pytest.mark.slow
def test_replicate_2_jobs_hold_both_slots_through_asha_and_equal_their_standalone_and_plain_runs(
        tmp_path, corpus_file, cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir,
                      sweep='scheduler = "planned"\nplans = ["replicate(2)"]\nearly_stop = "asha"\nasha_min_steps = 2\n'
                            'asha_eta = 2', grid='"optim.lr" = [3e-3, 3e-5]', steps=4,
                      extra="grad_accum = 2\neval_interval = 2")
    lines: list[str] = []
    sweep = run_sweep(path, say=lines.append)
    got = rows(sweep.dir)
    assert got["j000"]["status"] == "done" and got["j001"]["status"] == "stopped", (got, lines)
    started = [ln for ln in lines if ": started on" in ln]
    assert len(started) == 3 and all("slots 0,1" in ln and "as replicate(2)" in ln for ln in started), lines
    # each needs both slots: one job's segment after the other's, and the promotion from the rung's checkpoint
    assert lines.index(next(ln for ln in lines if "j000: at rung 2" in ln)) < lines.index(started[1])
    assert any("j000: promoted at step 2" in ln for ln in lines) and "steps 2 → 4" in started[2]
    job_toml = sweep.dir / "jobs" / "j000" / "job.toml"
    cfg = load_config(job_toml)
    assert cfg.parallel.plan == "replicate(2)" and cfg.train.grad_accum == 1 and cfg.plan.world_size() == 2
    swept = job_losses(sweep.dir, "j000")
    assert swept == train_alone(job_toml, tmp_path / "alone")
    plain = standalone_losses(path, "j000", tmp_path / "plain")
    assert close(swept, plain), (swept, plain)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _ranks(launcher: int) -> list[int]:
    """The launcher's ranks, once both started: its children, or (forked ranks) the children of the forkserver
    it started."""
    kids = _children(launcher)
    return [g for k in kids for g in _children(k)] or kids


@pytest.mark.slow
def test_a_killed_rank_fails_the_attempt_and_the_retry_resumes_to_the_plain_losses(tmp_path, corpus_file,
                                                                                    cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir,
                      sweep='scheduler = "planned"\nplans = ["pipeline(2)"]\nretries = 1',
                      grid='"train.seed" = [3]', steps=16, extra="grad_accum = 2\neval_interval = 0\nckpt_interval = 4")
    sweep_dir = tmp_path / "sw"
    killed: list[int] = []

    killer = kill_midway(sweep_dir, "j000", 6, lambda pid: (_ranks(pid)[1:] or [None])[0], killed)
    lines: list[str] = []
    run_sweep(path, say=lines.append)
    killer.join()
    got = rows(sweep_dir)
    assert killed, "the test never saw the job's ranks"
    assert got["j000"]["status"] == "done" and got["j000"]["attempts"] == 1, (got, lines)
    assert any("j000: failed: exit code 3: rank 1 was killed by SIGKILL" in ln for ln in lines), lines
    swept = job_losses(sweep_dir, "j000")  # every step once: the retry resumed from the checkpoint
    plain = standalone_losses(path, "j000", tmp_path / "plain")
    assert close(swept, plain), (swept, plain)


@pytest.mark.slow
def test_kill_9_of_the_sweep_mid_replicate_job_then_rerun_resumes_it_as_it_started(tmp_path, corpus_file,
                                                                                    cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep='scheduler = "planned"\nplans = ["replicate(2)"]',
                      grid='"train.seed" = [4]', steps=16, extra="grad_accum = 2\neval_interval = 0\nckpt_interval = 4")
    sweep_dir = tmp_path / "sw"
    proc = sweep_process(path)
    try:
        deadline = time.monotonic() + 180
        job_dir = sweep_dir / "jobs" / "j000"
        while not (job_dir / "metrics.jsonl").exists() or len(read_metrics(job_dir)) < 6:
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.monotonic() < deadline, "the job never got to step 6"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    lines: list[str] = []
    run_sweep(path, say=lines.append)
    got = rows(sweep_dir)
    assert got["j000"]["status"] == "done" and got["j000"]["attempts"] == 0, (got, lines)
    assert any("j000: was running when the sweep stopped" in ln for ln in lines)
    assert any("j000: started on slots 0,1" in ln and "as replicate(2), steps " in ln for ln in lines)
    swept = job_losses(sweep_dir, "j000")  # every step once, resumed from its checkpoint as replicate(2)
    assert close(swept, standalone_losses(path, "j000", tmp_path / "plain"))



@pytest.mark.slow
def test_a_replicate_2_job_over_named_device_slots_equals_its_standalone_run(tmp_path, corpus_file, cache_dir):
    """sweep.devices with a plan over several slots: the job's ranks run on its slots' devices (here both on the
    CPU: `--set train.device='cpu'`), and equal `stratum train --config job.toml`."""
    path = sweep_file(tmp_path, corpus_file, cache_dir,
                      sweep='scheduler = "planned"\nplans = ["replicate(2)"]\ndevices = ["cpu", "cpu"]',
                      grid='"optim.lr" = [3e-3]', steps=2, extra="grad_accum = 2")
    lines: list[str] = []
    sweep = run_sweep(path, say=lines.append)
    assert rows(sweep.dir)["j000"]["status"] == "done", lines
    assert any("started on slots 0,1" in ln and "as replicate(2)" in ln for ln in lines), lines
    job_toml = sweep.dir / "jobs" / "j000" / "job.toml"
    assert job_losses(sweep.dir, "j000") == train_alone(job_toml, tmp_path / "alone")
