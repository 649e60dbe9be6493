"""sharded-lrtf (Hydra's rule at shard level): the rule on a hand-computable case, and a real sweep whose jobs run
as interleaved shard tasks under the offload engine — each job's losses equal to its `stratum train`, its device
tier under the budget its state exceeds, every grant the rule's choice."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from stratum.config import config_from_dict
from stratum.errors import StratumError
from stratum.sweep.predict import job_profiles, memory_need
from stratum.sweep.runner import Sweep, open_sweep, run_sweep
from stratum.sweep.segment import checkpoint_step
from stratum.sweep.setup import write_job_configs
from stratum.sweep.shape_cost import shape_key
from stratum.sweep.shard_lrtf import GiveBack, makespan, pick_longest, sharded_lrtf, task_table, tasks_per_step
from stratum.sweep.shard_run import check_shardable, report_missed
from stratum.sweep.shard_worker import ShardJob, run_shard_jobs
from stratum.sweep.spec import load_sweep
from stratum.train.trainer import read_metrics
from stratum.units import parse_budget
from tests.test_sweep_run import job_losses, rows, standalone_losses, standalone_records, sweep_file

BUDGET = "1.4MB"
ROOMLESS = "4.2MB"
"""sweep.device_memory of exactly 2 running jobs' budgets and one staged's: every waiting job gives back."""
SHARDED = f'scheduler = "sharded-lrtf"\ndevice_budget = "{BUDGET}"\nshard_blocks = 2\ndevice_memory = "{ROOMLESS}"'
PINNED_PLACEMENT = '[offload]\nresident_chunks = 6\noptimizer_tier = "host"\nprefetch_depth = 4'
"""The sweep's offload placement's choices that decide whether a job's next shard has chunks to fetch, pinned:
chosen by the planner they follow the bandwidths measured at start-up, which move with the machine's load."""


def test_the_rule_on_a_hand_computed_case_as_a_table():
    # t=0: both slots free, all ready: b (6 s left) → slot 0, then a (2) over c (1) → slot 1.
    # t=1: slot 1 frees; b runs, so a (1 left) and c (1) tie: sweep order takes a. t=2: both free; b (4) → slot 0,
    # c → slot 1. t=3: slot 1 frees, nothing ready (b runs until 4): it idles. t=4: b's last task → slot 0.
    tasks = sharded_lrtf({"a": [1, 1], "b": [2, 2, 2], "c": [1]}, 2)
    assert task_table(tasks) == "\n".join([
        "   start      end slot  task",
        "       0        2    0  b[0]",
        "       0        1    1  a[0]",
        "       1        2    1  a[1]",
        "       2        4    0  b[1]",
        "       2        3    1  c[0]",
        "       4        6    0  b[2]"])
    assert makespan(tasks) == 6.0
    # a job's tasks form a chain: never two at once, each after the previous one
    for job in "abc":
        mine = [t for t in tasks if t.job == job]
        assert all(x.end <= y.start for x, y in zip(mine, mine[1:]))
    assert tasks_per_step(5, 2, 3) == 2 * 3 * 3


@pytest.mark.parametrize(("capacity", "table", "span"), [
    # no room beside 1 running and 1 staged budget: every job that yields gives back, holding the slot its seconds
    (2, ["       0        1    0  a[0] gives back",
         "     1.5      2.5    0  b[0] gives back",
         "    2.75     3.75    0  c[0] gives back",
         "    3.88     4.88    0  a[1]",  # (a's last task: nothing left to give back for)
         "    4.88     5.88    0  b[1]",
         "    5.88     6.88    0  c[1]"], 6.875),
    # room for one waiting job's budget: a keeps (nobody holds), b must give back (a holds), c keeps (a, granted
    # next, is no longer waiting)
    (3, ["       0        1    0  a[0]",
         "       1        2    0  b[0] gives back",
         "    2.25     3.25    0  c[0]",
         "    3.25     4.25    0  a[1]",
         "    4.25     5.25    0  b[1]",
         "    5.25     6.25    0  c[1]"], 6.25),
    (None, ["       0        1    0  a[0]",  # no limit: nobody gives back
            "       1        2    0  b[0]",
            "       2        3    0  c[0]",
            "       3        4    0  a[1]",
            "       4        5    0  b[1]",
            "       5        6    0  c[1]"], 6.0),
], ids=["no-room", "room-for-one", "no-limit"])
def test_a_yielding_job_gives_back_where_the_device_lacks_room_as_a_table(capacity, table, span):
    # three jobs of two 1 s tasks on one slot, alternating as their remaining times tie (sweep order first)
    gives = GiveBack(seconds={"a": 0.5, "b": 0.25, "c": 0.125}, capacity=capacity, budget=1)
    tasks = sharded_lrtf({"a": [1, 1], "b": [1, 1], "c": [1, 1]}, 1, gives)
    assert task_table(tasks) == "\n".join(["   start      end slot  task", *table])
    assert makespan(tasks) == span


JOB_SHAPE = config_from_dict({"model": {"preset": "tiny", "dropout": 0.1}, "data": {"seq_len": 32},
                              "train": {"micro_batch_size": 4, "engine": "offload"}})
HAND_CALIBRATION = {"key": "written by hand", "kind": "sharded-lrtf", "calibration": {
    "fixed_s": 0.0, "fixed_s_per_byte": 0.0, "step_scale": 1.0, "step_overhead_s": 0.0, "contention": 1.0},
    "shapes": {shape_key(JOB_SHAPE): {"label": "tiny", "fixed_s": 50.0, "step_s": 10.0}}}
"""The sweep's sharded calibration (sweep.calibration): its jobs' one shape holds a slot 50 s + 10 s a step."""


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, corpus_file, cache_dir):
    """The sweep — its jobs with dropout (each job's thread draws its own masks beside the others'); j003
    diverges at step 2 (lr 1e5) — its worker asked to stop (SIGTERM) once midway: the jobs leave at a shard
    boundary and a new worker resumes them from their checkpoints."""
    tmp = tmp_path_factory.mktemp("shards")
    (tmp / "cal.json").write_text(json.dumps(HAND_CALIBRATION))
    path = sweep_file(tmp, corpus_file, cache_dir, sweep=SHARDED + "\nretries = 0\ncalibration = \"cal.json\"",
                      grid='"optim.lr" = [1e-3, 1e5]\n"train.steps" = [1, 3]\n"model.dropout" = [0.1]', steps=2,
                      extra="eval_interval = 2\nckpt_interval = 1\n" + PINNED_PLACEMENT)
    grants = tmp / "sw" / "shard_tasks.jsonl"
    # early: the runner looks every 0.2 s, in which a tiny job's worker may record several grants; stopped once
    # the two longest jobs have started, the short ones are still waiting, so a second worker always runs them
    midway = lambda _: grants.exists() and len(grants.read_text().splitlines()) >= 6  # noqa: E731
    return (path, tmp, *run_stopping_the_worker_once(path, midway))


def run_stopping_the_worker_once(path: Path, when: Callable[[Sweep], bool]) -> tuple[list[str], list[int]]:
    """Run the sweep, sending its shard worker SIGTERM the first time ``when`` holds; its lines, and the pid
    stopped."""
    lines: list[str] = []
    stopped: list[int] = []

    def stop_once(sweep: Sweep) -> None:
        pids = {r.pid for r in sweep.state.jobs() if r.pid is not None}
        if not stopped and pids and when(sweep):
            stopped.append(pids.pop())
            os.kill(stopped[0], signal.SIGTERM)

    run_sweep(path, say=lines.append, tick=stop_once)
    return lines, stopped


def test_every_job_equals_its_stratum_train_run(sharded, tmp_path):
    path, tmp, lines, stopped = sharded
    got = rows(tmp / "sw")
    assert {j: (r["status"], r["step"], r["attempts"]) for j, r in got.items()} == {
        "j000": ("done", 1, 0), "j001": ("done", 3, 0), "j002": ("done", 1, 0), "j003": ("failed", 2, 1)}, lines
    assert "became nan at step 3" in got["j003"]["reason"]  # its own failure; the others finished
    assert stopped and sum(ln.startswith("sharded-lrtf: ") for ln in lines) >= 2, lines  # stopped, resumed
    for job_id in ("j000", "j001", "j002"):
        job_toml = (tmp / "sw" / "jobs" / job_id / "job.toml").read_text()
        assert "engine = \"offload\"" in job_toml  # what `stratum train --config job.toml` repeats
        assert job_losses(tmp / "sw", job_id) == standalone_losses(path, job_id, tmp_path / job_id, [
            "train.engine='offload'", f"offload.device_budget={BUDGET!r}"])


def test_the_predicted_makespan_replays_the_rule_over_the_calibrated_chains(sharded):
    """The hand calibration's 50 s + 10 s a step: j000 and j002 (1 step) 60 s, j001 and j003 (3 steps) 80 s, each
    in chains of 4 tasks a step; the rule packs the 280 s on 2 slots with none idle: 140 s, with give-backs (no
    room to spare), each free (the calibration prices none)."""
    _, _, lines, _ = sharded
    first = next(ln for ln in lines if ln.startswith("predicted makespan:"))
    assert first.startswith("predicted makespan: 140.0 s (SIMULATED from calibrated job times, ") and \
        first.endswith(" give-backs)"), first


def test_jobs_whose_state_exceeds_the_budget_run_under_it(sharded):
    path, tmp, _, _ = sharded
    sweep = open_sweep(path, say=lambda _: None)
    profiles = job_profiles(sweep.configs, threads=1, cache_dir=tmp / "sw" / "profiles")
    budget = parse_budget(BUDGET, "budget")
    for job_id in ("j000", "j001", "j002"):
        assert memory_need(profiles[job_id]) > budget
        peaks = [r["offload_device_peak_bytes"] for r in read_metrics(tmp / "sw" / "jobs" / job_id)]
        assert peaks and max(peaks) <= budget


def test_every_grant_is_the_rule_s_choice(sharded):
    path, tmp, _, _ = sharded
    records = [json.loads(ln) for ln in (tmp / "sw" / "shard_tasks.jsonl").read_text().splitlines()]
    grants = [r for r in records if "remaining" in r]  # (the others: jobs' ends and stages)
    order = ["j000", "j001", "j002", "j003"]
    workers = [i for i, g in enumerate(grants) if i == 0 or g["t"] < grants[i - 1]["t"]]  # each starts at t ≈ 0
    runs = [grants[a:b] for a, b in zip(workers, workers[1:] + [len(grants)])]
    assert len(runs) >= 2
    for run in runs:  # a worker's first grant compares every job it holds (some may wait past a stop)
        assert {g["job"] for g in run} <= set(run[0]["remaining"])
    assert set(runs[0][0]["remaining"]) == set(order)
    # what the rule compares at the start is the calibration's (50 s + 10 s a step): train.steps 1, 3, 1, 3
    assert runs[0][0]["remaining"] == pytest.approx({"j000": 60.0, "j001": 80.0, "j002": 60.0, "j003": 80.0})
    for g in grants:
        assert g["job"] == pick_longest(g["remaining"], order), g
    assert {g["slot"] for g in grants} == {0, 1}
    # the worker a finished job ends in runs its chain to the end: one grant per task from its checkpoint, and
    # one for the tail after the last boundary (update, checkpoint, summary); remaining times fall by a task each
    sweep = open_sweep(path, say=lambda _: None)
    blocks = len(job_profiles(sweep.configs, threads=1, cache_dir=tmp / "sw" / "profiles")["j000"].blocks)
    for job in ("j000", "j001", "j002"):
        run = next(r for r in reversed(runs) if any(g["job"] == job for g in r))
        mine = [g["remaining"][job] for g in run if g["job"] == job]
        assert mine == sorted(mine, reverse=True) and len(set(mine)) == len(mine)
        left = round(mine[0] / (mine[0] - mine[1])) if len(mine) > 1 else 0
        assert len(mine) == 1 + left and left % tasks_per_step(blocks, 2, 1) == 0


def test_sharded_lrtf_needs_a_budget(tmp_path, corpus_file, cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep='scheduler = "sharded-lrtf"',
                      grid='"optim.lr" = [1e-3]', steps=2)
    with pytest.raises(StratumError, match="set sweep.device_budget"):
        load_sweep(path)


def test_a_background_job_is_refused_under_sharded_lrtf(tmp_path, corpus_file, cache_dir):
    """Its jobs are threads of one worker: a background job's SCHED_IDLE would be every job's."""
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep='scheduler = "sharded-lrtf"\ndevice_budget = "50MB"',
                      grid='"train.priority" = ["normal", "background"]', steps=2)
    with pytest.raises(StratumError, match="train.priority = 'background' needs another scheduler"):
        open_sweep(path, say=lambda _: None)
    assert not (Path(load_sweep(path).settings.out_dir) / "state.db").exists()


def test_a_foreground_job_is_a_threads_own_under_sharded_lrtf():
    """A foreground job's stream priority belongs to its thread alone, so it shares a worker with other jobs."""
    jobs = {p: config_from_dict({"train": {"priority": p, "engine": "offload"}}) for p in ("normal", "foreground")}
    check_shardable(jobs)
    with pytest.raises(StratumError, match="job background: .*needs another scheduler"):
        check_shardable({**jobs, "background": config_from_dict({"train": {"priority": "background"}})})


@pytest.mark.slow
def test_fp16_jobs_skip_and_scale_as_alone(tmp_path, corpus_file, cache_dir):
    """fp16 jobs interleaved (each engine its own loss scaler): a first scale that overflows, so both skip steps
    and back off side by side, then train; losses, scales and skips equal each job's `stratum train`."""
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep=SHARDED,
                      grid='"optim.lr" = [1e-3, 3e-3]\n"model.dropout" = [0.1]', steps=5,
                      extra="eval_interval = 5\nprecision = \"fp16\"\nloss_scale = 524288.0\n"
                            "loss_scale_growth_interval = 2")
    lines: list[str] = []
    run_sweep(path, say=lines.append)
    assert {j: r["status"] for j, r in rows(tmp_path / "sw").items()} == {"j000": "done", "j001": "done"}, lines
    for job_id in ("j000", "j001"):
        swept = read_metrics(tmp_path / "sw" / "jobs" / job_id)
        assert [r["skipped"] for r in swept][:3] == [1, 1, 1] and swept[-1]["skipped"] == 0
        alone = standalone_records(path, job_id, tmp_path / job_id, ["train.engine='offload'",
                                                                     f"offload.device_budget={BUDGET!r}"])
        assert [(r["loss"], r["loss_scale"], r["skipped"]) for r in swept] == [
            (r["loss"], r["loss_scale"], r["skipped"]) for r in alone]


def test_the_job_next_in_line_stages_its_next_shard_while_others_compute(sharded):
    """While every slot is busy, the waiting job that the next freed slot goes to stages its next shard (the
    engine's stage hook), once per wait, and is then granted that task; its losses stay its `stratum train` run's
    (the test above)."""
    _, tmp, _, _ = sharded
    records = [json.loads(ln) for ln in (tmp / "sw" / "shard_tasks.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if i == 0 or r["t"] < records[i - 1]["t"]]  # a new worker
    runs = [records[a:b] for a, b in zip(starts, starts[1:] + [len(records)])]
    stages = [r for r in records if "stage" in r]
    # that a stage moves chunks is tests/test_offload_stage.py's (deterministic there); here, how many it moves
    # depends on where each job's wait falls (a job's first step records its access sequence: nothing to stage
    # from yet), which the machine's load decides
    assert stages and all(r["chunks"] >= 0 for r in stages)
    for run in runs:  # once per wait: one stage per job and task
        keys = [(r["job"], r["stage"]) for r in run if "stage" in r]
        assert len(keys) == len(set(keys))
    last = runs[-1]  # the worker that runs its jobs to their ends: each staged task is then granted
    grants = {(r["job"], r["task"]) for r in last if "remaining" in r}
    assert all((r["job"], r["stage"]) in grants for r in last if "stage" in r)


def test_a_job_gives_its_device_slots_back_before_another_takes_its_slot(sharded):
    """A job that yields its slot to another gives its engine's device slots back first, and a staged job
    overtaken by another gives them back before that one stages: read off the log, at most slots + 1 jobs (the
    running ones and one staged) hold slot memory at any grant; each grant records the jobs' device bytes."""
    _, tmp, _, _ = sharded
    records = [json.loads(ln) for ln in (tmp / "sw" / "shard_tasks.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if i == 0 or r["t"] < records[i - 1]["t"]]  # a new worker
    for run in [records[a:b] for a, b in zip(starts, starts[1:] + [len(records)])]:
        holding: set[str] = set()
        for r in run:
            if "remaining" in r:
                holding.add(r["job"])
                assert len(holding) <= 2 + 1, r
            elif r.get("end") or "vacate" in r or "unstage" in r:
                holding.discard(r["job"])
            elif "stage" in r and r["chunks"]:
                holding.add(r["job"])
    assert any(r.get("vacate", 0) > 0 for r in records)
    assert any(r.get("device_bytes") for r in records if "remaining" in r)


def test_jobs_bound_to_devices_train_as_alone(tmp_path, corpus_file, cache_dir):
    """sweep.devices under sharded-lrtf (here both slots on the CPU, without sweep.device_memory: no limit, so a
    waiting job keeps its memory — a give-back there would only copy): each job trained on its slots' device,
    with its `stratum train` run's losses."""
    unlimited = SHARDED.replace(f'\ndevice_memory = "{ROOMLESS}"', "")
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep=unlimited + '\ndevices = ["cpu", "cpu"]',
                      grid='"optim.lr" = [1e-3, 2e-3, 3e-3]', steps=2, extra=PINNED_PLACEMENT)
    lines: list[str] = []
    run_sweep(path, say=lines.append)
    assert {j: r["status"] for j, r in rows(tmp_path / "sw").items()} == dict.fromkeys(
        ("j000", "j001", "j002"), "done"), lines
    assert any("on 2 slot(s) on cpu" in ln for ln in lines), lines
    records = [json.loads(ln) for ln in (tmp_path / "sw" / "shard_tasks.jsonl").read_text().splitlines()]
    assert any(r.get("keep", 0) > 0 for r in records) and not any("vacate" in r for r in records)
    for job_id in ("j000", "j001", "j002"):
        assert job_losses(tmp_path / "sw", job_id) == standalone_losses(path, job_id, tmp_path / job_id, [
            "train.engine='offload'", f"offload.device_budget={BUDGET!r}"])


@pytest.fixture(scope="module")
def asha_sharded(tmp_path_factory, corpus_file, cache_dir):
    """An ASHA sweep under sharded-lrtf — two learning rates, with and without dropout; rung at step 3 of 6 —
    its worker asked to stop (SIGTERM) once the first job reports at the rung: a new worker takes the pending
    jobs and the paused one, from the sweep state."""
    tmp = tmp_path_factory.mktemp("shards_asha")
    (tmp / "cal.json").write_text(json.dumps(HAND_CALIBRATION))
    path = sweep_file(tmp, corpus_file, cache_dir, sweep=SHARDED + '\ncalibration = "cal.json"\nearly_stop = "asha"'
                      '\nasha_min_steps = 3\nasha_eta = 2', grid='"optim.lr" = [3e-3, 3e-5]\n"model.dropout" = [0.0, 0.1]',
                      steps=6, extra="eval_interval = 3\nckpt_interval = 1\n" + PINNED_PLACEMENT)
    return (path, tmp, *run_stopping_the_worker_once(path, lambda sweep: bool(sweep.state.rungs())))


def test_asha_under_sharded_lrtf_stops_the_worst_and_promoted_jobs_keep_parity(asha_sharded, tmp_path):
    path, tmp, lines, stopped = asha_sharded
    got = rows(tmp / "sw")
    db = sqlite3.connect(tmp / "sw" / "state.db")
    rung3 = dict(db.execute("SELECT job, metric FROM rungs WHERE step = 3").fetchall())
    db.close()
    assert sorted(rung3) == ["j000", "j001", "j002", "j003"], lines
    assert stopped and sum(ln.startswith("sharded-lrtf: ") for ln in lines) >= 2, lines  # stopped, resumed
    # what the worker's jobs did, said while they ran: each one's first step, its eval losses, its rung waits
    for job_id in rung3:
        assert any(ln.startswith(f"{job_id}: training from step ") for ln in lines), lines
        assert any(ln.startswith(f"{job_id}: step 3/6, eval loss ") for ln in lines), lines
    assert any(ln.endswith("waits at the rung of step 3") for ln in lines), lines
    done = {j for j, r in got.items() if r["status"] == "done"}
    out = {j for j, r in got.items() if r["status"] == "stopped"}
    assert out and done and done | out == set(rung3), got
    assert all(got[j]["step"] == 3 and "asha" in got[j]["reason"] for j in out)
    # the best half at the rung goes on (a job promoted early may too); the worst there never does
    assert set(sorted(rung3, key=rung3.get)[:2]) <= done and max(rung3, key=rung3.get) in out
    assert [r for r in csv.DictReader(open(tmp / "sw" / "results.csv")) if r["status"] == "stopped"]
    for job_id in sorted(done)[:2]:
        assert job_losses(tmp / "sw", job_id) == standalone_losses(path, job_id, tmp_path / job_id, [
            "train.engine='offload'", f"offload.device_budget={BUDGET!r}"])
    for job_id in out:  # its 3 steps, once each, and nothing past the rung
        assert len(job_losses(tmp / "sw", job_id)) == 3


def test_a_job_killed_between_its_rung_checkpoint_and_its_report_is_reported_on_resume(asha_sharded, tmp_path):
    """As a sweep killed in that moment leaves it: the job pending, its checkpoint at the rung, no report. The
    next run reports it from its metrics before it starts a worker, so it pauses there as it would have."""
    path, tmp, _, _ = asha_sharded
    shutil.copytree(tmp / "sw", tmp_path / "sw")
    shutil.copy(tmp / "cal.json", tmp_path / "cal.json")
    path = Path(shutil.copy(path, tmp_path / "sweep.toml"))
    path.write_text(path.read_text().replace(str(tmp), str(tmp_path)))
    sweep = open_sweep(path, say=lambda _: None)
    stopped = next(j for j, r in rows(tmp_path / "sw").items() if r["status"] == "stopped")
    metric = dict((j, m) for j, s, m in sweep.state.rungs() if s == 3)[stopped]
    db = sqlite3.connect(tmp_path / "sw" / "state.db")
    with db:
        db.execute("DELETE FROM rungs WHERE job = ?", (stopped,))
        db.execute("UPDATE jobs SET status = 'pending', reason = '' WHERE id = ?", (stopped,))
    db.close()
    assert sweep.asha is not None
    report_missed(sweep.state, sweep.configs, sweep.asha)
    row = rows(tmp_path / "sw")[stopped]
    assert (row["status"], row["step"], row["eval_loss"]) == ("paused", 3, metric)
    assert (stopped, 3, metric) in sweep.state.rungs()



def test_a_job_giving_back_at_every_shard_boundary_trains_as_alone(tmp_path, corpus_file, cache_dir):
    """The calibration's measure of a give-back (``ShardJob.gives_back_every_task``): each job gives its device
    memory back at every shard boundary, whether it yields its slot or not — one vacate per task, each
    releasing bytes and timed — and its losses equal its config's run alone."""
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep=SHARDED, grid='"optim.lr" = [1e-3, 2e-3]', steps=2,
                      extra="eval_interval = 0\nckpt_interval = 0\n" + PINNED_PLACEMENT)
    sweep = open_sweep(path, say=lambda _: None)
    write_job_configs(sweep)
    per_step = 2 * 2  # tiny's 4 blocks in shards of 2, forward and backward, one micro-batch
    jobs = [ShardJob(id=j, config_path=str(sweep.dir / "jobs" / j / "job.toml"), tasks_left=2 * per_step,
                     task_s=1.0, shard_blocks=2, gives_back_every_task=True) for j in sweep.jobs]
    assert run_shard_jobs(jobs, slots=1, threads=1, sweep_dir=sweep.dir) == {"j000": 0, "j001": 0}
    records = [json.loads(ln) for ln in (sweep.dir / "shard_tasks.jsonl").read_text().splitlines()]
    for j in sweep.jobs:
        vacates = [r for r in records if r.get("job") == j and "vacate" in r]
        assert len(vacates) == 2 * per_step and all(r["vacate"] > 0 and r["s"] >= 0 for r in vacates), vacates
        assert job_losses(sweep.dir, j) == standalone_losses(path, j, tmp_path / j, [
            "train.engine='offload'", f"offload.device_budget={BUDGET!r}"])


def test_a_stop_lets_started_jobs_end_their_step_with_a_checkpoint(tmp_path, corpus_file, cache_dir):
    """SIGTERM to the shard worker mid-run, with no periodic checkpoint: every job that started ends its step —
    its shard tasks still granted — and saves it (its last checkpoint is its last step trained), then stops
    (exit 130); none runs to its end."""
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep=SHARDED, grid='"optim.lr" = [1e-3, 2e-3, 3e-3]',
                      steps=400, extra="eval_interval = 0\nckpt_interval = 0\n" + PINNED_PLACEMENT)
    sweep = open_sweep(path, say=lambda _: None)
    write_job_configs(sweep)
    outs = {j: sweep.dir / "jobs" / j for j in sweep.jobs}
    jobs = [ShardJob(id=j, config_path=str(out / "job.toml"), tasks_left=100, task_s=1.0, shard_blocks=2)
            for j, out in outs.items()]

    def stop_when_training() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(len(read_metrics(o)) >= 2 for o in outs.values()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # (the worker's handler, in this main thread)

    threading.Thread(target=stop_when_training, daemon=True).start()
    codes = run_shard_jobs(jobs, slots=2, threads=1, sweep_dir=sweep.dir)
    trained = {j: read_metrics(o) for j, o in outs.items()}
    assert any(len(r) >= 2 for r in trained.values()) and all(len(r) < 400 for r in trained.values())
    for job_id, records in trained.items():
        assert codes[job_id] == 130, codes
        assert checkpoint_step(outs[job_id]) == (records[-1]["step"] if records else 0), job_id
