"""Real sweeps on local worker processes: parity with `stratum train`, resume after kill -9, failed and killed
jobs, ASHA, results and status."""

from __future__ import annotations

import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stratum.cli import main
from stratum.errors import StratumError
from stratum.procs import pid_alive
from stratum.sweep.expand import expand, job_config
from stratum.sweep.launched import LaunchedWorker
from stratum.sweep.local import start_process
from stratum.sweep.plain_calibrate import measure
from stratum.sweep.predict import job_profiles
from stratum.sweep.results import makespan_line
from stratum.sweep.runner import open_sweep, run_sweep, wait_for_an_end
from stratum.sweep.segment import Segment
from stratum.sweep.shape_cost import shape_key
from stratum.sweep.spec import load_sweep
from stratum.sweep.state import SweepState
from stratum.train.checkpoint import latest_checkpoint
from stratum.train.trainer import read_metrics, train

REPO = Path(__file__).resolve().parent.parent


def sweep_file(tmp_path: Path, corpus: Path, cache: Path, *, sweep: str, grid: str, steps: int, extra: str = "",
               name: str = "sweep.toml") -> Path:
    p = tmp_path / name
    p.write_text(f"""[sweep]
out_dir = "{tmp_path / 'sw'}"
slots = 2
{sweep}
[sweep.grid]
{grid}
[model]
preset = "tiny"
[data]
corpus = "{corpus}"
cache_dir = "{cache}"
seq_len = 32
[train]
steps = {steps}
micro_batch_size = 4
eval_batches = 2
ckpt_minutes = 0.0
{extra}
[optim]
warmup_steps = 2
min_lr = 1e-6
""")
    return p


def standalone_losses(path: Path, job_id: str, tmp_path: Path, extra: list[str] = ()) -> list[float]:
    """The losses of the job's config run alone (:func:`standalone_records`)."""
    return [r["loss"] for r in standalone_records(path, job_id, tmp_path, extra)]


def standalone_records(path: Path, job_id: str, tmp_path: Path, extra: list[str] = ()) -> list[dict]:
    """The metrics of the job's config (with ``extra`` overrides, as the sweep gave it) run alone, in this
    process, as `stratum train` runs it (same thread count as a worker)."""
    spec = load_sweep(path)
    job = next(j for j in expand(spec) if j.id == job_id)
    cfg = job_config(spec, job, tmp_path / "alone", extra)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.settings.slots))
    try:
        train(cfg)
    finally:
        torch.set_num_threads(threads)
    return read_metrics(cfg.train.out_dir)


def job_losses(sweep_dir: Path, job_id: str) -> list[float]:
    recs = read_metrics(sweep_dir / "jobs" / job_id)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1))  # every step once
    return [r["loss"] for r in recs]


def rows(sweep_dir: Path) -> dict[str, dict]:
    db = sqlite3.connect(sweep_dir / "state.db")
    db.row_factory = sqlite3.Row
    out = {r["id"]: dict(r) for r in db.execute("SELECT * FROM jobs")}
    db.close()
    return out


def run_and_read(path: Path, **kw) -> tuple[list[str], dict[str, dict]]:
    """Run the sweep in this process; its progress lines and its jobs' rows."""
    lines: list[str] = []
    sweep = run_sweep(path, say=lines.append, **kw)
    return lines, rows(sweep.dir)


def poll_rows(sweep_dir: Path) -> dict[str, dict]:
    """rows() of a sweep another thread or process is running: {} until its database has its tables."""
    try:
        return rows(sweep_dir) if (sweep_dir / "state.db").exists() else {}
    except sqlite3.OperationalError:  # the file exists, its schema is being written
        return {}


def sweep_process(path: Path) -> subprocess.Popen:
    """`stratum sweep --config path` in a process of its own (to kill -9)."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.Popen([sys.executable, "-m", "stratum", "sweep", "--config", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_midway(sweep_dir: Path, job_id: str, steps: int, victim: Callable[[int], int | None], killed: list[int],
                timeout_s: float = 180.0) -> threading.Thread:
    """A thread that SIGKILLs ``victim(worker pid)`` (None: not yet) once the job runs and has logged ``steps``
    steps, and appends its pid to ``killed``."""
    def kill() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not killed:
            r = poll_rows(sweep_dir).get(job_id)
            if r and r["status"] == "running" and r["pid"] and len(read_metrics(sweep_dir / "jobs" / job_id)) >= steps:
                pid = victim(r["pid"])
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)
    thread = threading.Thread(target=kill)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def four_jobs(tmp_path_factory, corpus_file, cache_dir):
    """fifo over 4 jobs of one shape, with a calibration written by hand (5 s + 1 s a step) for its prediction."""
    tmp = tmp_path_factory.mktemp("sweep4")
    grid = '"optim.lr" = [1e-3, 3e-3]\n"train.seed" = [1, 2]'
    write_hand_calibration(tmp, corpus_file, cache_dir, grid)
    path = sweep_file(tmp, corpus_file, cache_dir, sweep='calibration = "cal.json"', grid=grid, steps=6,
                      extra="eval_interval = 3")
    lines: list[str] = []
    run_sweep(path, say=lines.append)
    return path, tmp, lines


def write_hand_calibration(tmp: Path, corpus: Path, cache: Path, grid: str) -> None:
    """``tmp/cal.json``: a plain calibration of the grid's one job shape (tiny), 5 s + 1 s a step."""
    spec = load_sweep(sweep_file(tmp, corpus, cache, sweep="", grid=grid, steps=6, name="probe.toml"))
    shape = shape_key(job_config(spec, expand(spec)[0], tmp / "shape", []))
    (tmp / "cal.json").write_text(json.dumps({"key": "by hand", "kind": "plain", "calibration": {
        "fixed_s": 0.0, "fixed_s_per_byte": 0.0, "step_scale": 1.0, "step_overhead_s": 0.0, "contention": 1.0},
        "shapes": {shape: {"label": "tiny", "fixed_s": 5.0, "step_s": 1.0}}}))


def test_the_plain_calibration_measures_each_shape_alone_busy_and_restarted(tmp_path, corpus_file, cache_dir):
    """The calibration's own runs, for real: a tiny job's shape trains alone, is resumed from that run's
    checkpoint (what a restart costs beyond its steps), and trains as 2 copies at once."""
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep="", grid='"optim.lr" = [1e-3]', steps=4)
    configs = open_sweep(path, say=lambda _: None).configs
    profiles = job_profiles(configs, threads=1, cache_dir=None)
    cal = measure(list(configs.values()), list(profiles.values()), threads=1, slots=2, work_dir=tmp_path / "cal")
    shape = shape_key(next(iter(configs.values())))
    assert set(cal.shapes) == set(cal.alone) == set(cal.restart) == {shape}
    assert cal.alone[shape].step_s > 0 and cal.shapes[shape].step_s > 0 and 0 < cal.restart[shape] < 60
    resumed = read_metrics(tmp_path / "cal" / "alone0" / "j0")
    assert [r["step"] for r in resumed] == list(range(1, 9))  # 4 steps, then 4 more from the checkpoint


def test_lrtf_s_checkpoint_slices_each_pay_the_start_up_again_in_its_prediction(tmp_path, corpus_file, cache_dir):
    """4 jobs of 6 steps in slices of 3, each 5 s + 1 s a step by the calibration, and 5 s again for its second
    slice: 16 s a job, 64 s of work on 2 slots, packed two slices at a time: 32 s (SIMULATED)."""
    grid = '"optim.lr" = [1e-3, 3e-3]\n"train.seed" = [1, 2]'
    write_hand_calibration(tmp_path, corpus_file, cache_dir, grid)
    path = sweep_file(tmp_path, corpus_file, cache_dir, grid=grid, steps=6, extra="eval_interval = 3",
                      sweep='scheduler = "lrtf"\nsegment_steps = 3\ncalibration = "cal.json"')
    lines: list[str] = []
    run_sweep(path, say=lines.append)
    assert "predicted makespan: 32.0 s (SIMULATED from calibrated job times)" in lines
    assert all(r["status"] == "done" and r["step"] == 6 for r in rows(tmp_path / "sw").values())


def test_the_predicted_makespan_is_printed_and_kept_beside_the_measured_one(four_jobs):
    """Each job is predicted 5 + 6 × 1 = 11 s; fifo runs two at a time on 2 slots: 22 s (SIMULATED)."""
    _, tmp, lines = four_jobs
    assert "predicted makespan: 22.0 s (SIMULATED from calibrated job times)" in lines
    doc = json.loads((tmp / "sw" / "makespan.json").read_text())
    assert (doc["scheduler"], doc["predicted_s"], doc["predicted_from"]) == ("fifo", 22.0, "calibrated")
    assert doc["measured_s"] > 0
    assert f"makespan: {doc['measured_s']:.1f} s measured, 22.0 s predicted (SIMULATED): measured / predicted " \
           f"{doc['measured_s'] / 22.0:.2f}" in lines


def test_four_jobs_on_two_slots_each_equal_to_its_stratum_train(four_jobs, tmp_path):
    path, tmp, lines = four_jobs
    got = rows(tmp / "sw")
    assert sorted(got) == ["j000", "j001", "j002", "j003"]
    assert all(r["status"] == "done" and r["step"] == 6 for r in got.values())
    assert {r["slot"] for r in got.values()} == {0, 1}  # both slots used
    for job_id in got:
        assert job_losses(tmp / "sw", job_id) == standalone_losses(path, job_id, tmp_path / job_id)


def test_results_table_csv_png_and_status_command(four_jobs, capsys):
    path, tmp, lines = four_jobs
    with open(tmp / "sw" / "results.csv") as f:
        table = list(csv.DictReader(f))
    evals = [float(r["eval_loss"]) for r in table]
    assert evals == sorted(evals) and len(table) == 4
    assert (tmp / "sw" / "losses.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["sweep", "status", str(tmp / "sw")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith(table[0]["id"]) and "4 done" in out
    assert out.splitlines()[-1].startswith("makespan: ") and ", 22.0 s predicted (SIMULATED): " in out


def test_a_finished_sweep_run_again_reruns_nothing(four_jobs):
    path, tmp, _ = four_jobs
    before = {j: (tmp / "sw" / "jobs" / j / "metrics.jsonl").stat().st_mtime_ns for j in rows(tmp / "sw")}
    makespan = (tmp / "sw" / "makespan.json").read_text()
    lines: list[str] = []
    run_sweep(path, say=lines.append)
    assert not any("started" in ln for ln in lines)
    assert before == {j: (tmp / "sw" / "jobs" / j / "metrics.jsonl").stat().st_mtime_ns for j in rows(tmp / "sw")}
    # the measured makespan is the sweep's, not this no-op's
    assert (tmp / "sw" / "makespan.json").read_text() == makespan
    assert lines[-1] == makespan_line(json.loads(makespan)) and " s measured, 22.0 s predicted" in lines[-1]


def test_changed_settings_are_refused_and_a_segment_without_progress_fails(tmp_path, corpus_file, cache_dir):
    """Editing what the jobs train with in the sweep.base file (the sweep file unchanged) is refused on the rerun;
    and a job whose segments end well without training a step fails, where it was relaunched forever."""
    base = tmp_path / "base.toml"
    base.write_text("[optim]\nweight_decay = 0.1\n")
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep='retries = 1\nbase = "base.toml"',
                      grid='"optim.lr" = [1e-3]', steps=3)
    _, got = run_and_read(path)
    assert got["j000"]["status"] == "done"
    base.write_text("[optim]\nweight_decay = 0.2\n")
    with pytest.raises(StratumError, match="holds this sweep run with other settings: job j000's optim.weight_decay "
                                           "was 0.1, is now 0.2"):
        run_sweep(path, say=lambda _: None)
    base.write_text("[optim]\nweight_decay = 0.1\n")
    db = sqlite3.connect(tmp_path / "sw" / "state.db")  # the state asks for more steps than the run trains
    with db:
        db.execute("UPDATE jobs SET status = 'pending', steps = 5 WHERE id = 'j000'")
    db.close()
    lines, got = run_and_read(path)
    assert got["j000"]["status"] == "failed" and got["j000"]["attempts"] == 2, lines
    assert "ended without training a step (at step 3 of 5)" in got["j000"]["reason"]
    assert got["j000"]["step"] == 3 and got["j000"]["loss"] is not None  # its progress, from its checkpoint


def test_a_diverging_job_fails_a_killed_worker_is_retried_and_the_others_finish(tmp_path, corpus_file, cache_dir):
    # lrtf in slices of 20 steps: the jobs take turns, each resuming from its own checkpoint. Its predictions go
    # through a hand-written calibration (sweep.calibration): a job not yet run is predicted 100 s + 10 s a step
    cal = {"fixed_s": 100.0, "fixed_s_per_byte": 0.0, "step_scale": 0.0, "step_overhead_s": 10.0, "contention": 1.0}
    (tmp_path / "cal.json").write_text(json.dumps({"key": "written by hand", "kind": "plain", "calibration": cal,
                                                   "shapes": {}}))  # no shape measured: the line prices every job
    path = sweep_file(tmp_path, corpus_file, cache_dir,
                      sweep='retries = 1\nscheduler = "lrtf"\nsegment_steps = 20\ncalibration = "cal.json"',
                      grid='"optim.lr" = [3e-3, 1e5, 2e-3]', steps=60, extra="eval_interval = 0\nckpt_interval = 5")
    sweep_dir = tmp_path / "sw"
    killed: list[int] = []
    killer = kill_midway(sweep_dir, "j002", 12, lambda pid: pid, killed)
    lines: list[str] = []
    run_sweep(path, say=lines.append)
    killer.join()
    got = rows(sweep_dir)
    assert killed, "the test never saw j002 running"
    assert got["j000"]["status"] == "done" and got["j000"]["attempts"] == 0
    assert got["j001"]["status"] == "failed" and got["j001"]["attempts"] == 2 and "nan" in got["j001"]["reason"].lower()
    assert got["j002"]["status"] == "done" and got["j002"]["attempts"] == 1
    assert any("j002: failed: worker died (SIGKILL)" in ln for ln in lines)
    # the runner's predictions are the calibration's: every job's first slice, 60 steps left, 700 s
    for job_id in got:
        first = next(ln for ln in lines if ln.startswith(f"{job_id}: started"))
        assert first.endswith(", steps 0 → 20, 700 s predicted to its end (step 60)"), first
    # the retry resumed from its checkpoint and still trained exactly the standalone run
    assert job_losses(sweep_dir, "j002") == standalone_losses(path, "j002", tmp_path)


@pytest.mark.parametrize("how", ["SIGTERM to the sweep", "SIGINT to its process group"])
def test_a_stopped_sweep_stops_each_worker_once_with_a_checkpoint(tmp_path, corpus_file, cache_dir, how):
    """SIGTERM (timeout, systemd, Slurm) stops the sweep as Ctrl-C does; a terminal's Ctrl-C reaches the sweep and
    its workers at once, and the SIGTERM the sweep then sends must not end a worker before its checkpoint."""
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep="", grid='"optim.lr" = [1e-3, 3e-3]', steps=400,
                      extra="eval_interval = 0")
    sweep_dir = tmp_path / "sw"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "stratum", "sweep", "--config", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all(len(read_metrics(sweep_dir / "jobs" / j)) >= 3 for j in ("j000", "j001")):
            assert proc.poll() is None and time.monotonic() < deadline, "the jobs never ran together"
            time.sleep(0.05)
        if how.startswith("SIGTERM"):
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err
    got = rows(sweep_dir)
    for job_id in ("j000", "j001"):
        log = (sweep_dir / "jobs" / job_id / "worker.log").read_text()
        assert "Traceback" not in log and f"stopped by {how.split()[0]} at step" in log, log
        assert got[job_id]["status"] == "pending" and got[job_id]["step"] >= 3 and got[job_id]["loss"] is not None
        assert latest_checkpoint(sweep_dir / "jobs" / job_id).name == f"step_{got[job_id]['step']:08d}"


def test_kill_9_of_the_sweep_then_rerun_completes_every_job_once(tmp_path, corpus_file, cache_dir, capsys):
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep="",
                      grid='"optim.lr" = [1e-3, 3e-3]\n"train.seed" = [1, 2]', steps=24,
                      extra="eval_interval = 12\nckpt_interval = 4")
    sweep_dir = tmp_path / "sw"
    proc = sweep_process(path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            got = poll_rows(sweep_dir)
            done = [j for j, r in got.items() if r["status"] == "done"]
            mid = [j for j, r in got.items() if r["status"] == "running"
                   and len(read_metrics(sweep_dir / "jobs" / j)) >= 6]
            if done and mid:
                break
            assert proc.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("no job finished within 120 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    done_before = {j: (sweep_dir / "jobs" / j / "metrics.jsonl").stat().st_mtime_ns for j in done}
    # the state still records jobs as running; status tells they are not (the sweep holds no lock)
    assert main(["sweep", "status", str(sweep_dir)]) == 0
    out = capsys.readouterr().out
    rows_out = out.splitlines()[1:-2]
    assert any(" interrupted " in ln for ln in rows_out) and not any(" running " in ln for ln in rows_out), out
    assert out.splitlines()[-1].startswith("the sweep is not running"), out
    lines, got = run_and_read(path)
    assert all(r["status"] == "done" for r in got.values()), (got, lines)
    assert any(f"{mid[0]}: was running when the sweep stopped" in ln for ln in lines)
    assert not any(f"{j}: started" in ln for j in done for ln in lines)  # finished jobs are not rerun
    assert done_before == {j: (sweep_dir / "jobs" / j / "metrics.jsonl").stat().st_mtime_ns for j in done}
    for job_id in got:  # equal to an uninterrupted run of each job
        assert job_losses(sweep_dir, job_id) == standalone_losses(path, job_id, tmp_path / job_id)


def test_asha_stops_the_worse_jobs_at_the_rung_and_promoted_jobs_keep_parity(tmp_path, corpus_file, cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir,
                      sweep='early_stop = "asha"\nasha_min_steps = 3\nasha_eta = 2\nscheduler = "planned"',
                      grid='"optim.lr" = [1e-4, 3e-3, 1e-3, 3e-5]', steps=6, extra="eval_interval = 3")
    lines, got = run_and_read(path)
    db = sqlite3.connect(tmp_path / "sw" / "state.db")
    rung3 = dict(db.execute("SELECT job, metric FROM rungs WHERE step = 3").fetchall())
    db.close()
    assert sorted(rung3) == ["j000", "j001", "j002", "j003"]
    stopped = [j for j, r in got.items() if r["status"] == "stopped"]
    finished = [j for j, r in got.items() if r["status"] == "done"]
    assert stopped and finished and len(stopped) + len(finished) == 4
    assert all(got[j]["step"] == 3 and "asha" in got[j]["reason"] for j in stopped)
    # the slowest learner (lr 3e-5) is never among the best half at step 3
    assert "j003" in stopped and rung3["j003"] == max(rung3.values())
    for j in finished:
        assert job_losses(tmp_path / "sw", j) == standalone_losses(path, j, tmp_path / j)


def test_a_job_over_the_slot_budget_runs_under_the_offload_engine_within_it(tmp_path, corpus_file, cache_dir):
    # tiny (~2 MiB of state) fits 6 MB; mini (~14 MiB) does not and is spilled by the offload engine
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep='device_budget = "6MB"',
                      grid='"model.preset" = ["tiny", "mini"]', steps=4, extra="eval_interval = 0")
    lines, got = run_and_read(path)
    assert all(r["status"] == "done" for r in got.values())
    assert any("j001: needs" in ln and "offload engine" in ln for ln in lines)
    assert not any("j000: needs" in ln for ln in lines)
    job_cfg = (tmp_path / "sw" / "jobs" / "j001" / "job.toml").read_text()
    assert 'engine = "offload"' in job_cfg and 'device_budget = "6MB"' in job_cfg
    recs = read_metrics(tmp_path / "sw" / "jobs" / "j001")
    assert max(r["offload_device_peak_bytes"] for r in recs) <= 6_000_000
    # the offload engine reproduces the plain engine's losses (to float rounding of its chunked AdamW)
    assert job_losses(tmp_path / "sw", "j001") == pytest.approx(standalone_losses(path, "j001", tmp_path), rel=1e-6)


def test_a_budget_no_job_fits_is_refused_before_any_job_and_the_corrected_file_then_runs(tmp_path, corpus_file,
                                                                                          cache_dir):
    # 1 KB holds no chunk of either GPT: the offload planner's one-line error before any job starts, naming the
    # job that needs the most (its smallest budget fits them all); nothing is recorded, so the same out_dir takes
    # the corrected sweep (other jobs, another budget)
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep='device_budget = "1KB"',
                      grid='"model.preset" = ["tiny", "mini"]', steps=2, extra="eval_interval = 0")
    with pytest.raises(StratumError, match=r"^sweep job j001 \(and 1 more job\(s\) needing less\) under "
                                           r"sweep.device_budget: .*smallest[^\n]*$"):
        open_sweep(path, say=lambda line: None)
    assert SweepState(tmp_path / "sw").jobs() == []
    assert not (tmp_path / "sw" / "jobs" / "j000" / "checkpoints").exists()
    fixed = sweep_file(tmp_path, corpus_file, cache_dir, sweep='device_budget = "6MB"',
                       grid='"model.preset" = ["tiny", "mini"]', steps=2, extra="eval_interval = 0")
    sweep = open_sweep(fixed, say=lambda line: None)
    assert [r.id for r in sweep.state.jobs()] == ["j000", "j001"] and sweep.configs["j001"].train.engine == "offload"
    sweep.state.close()
    # the sweep resumed without the budget would switch j001's engine mid-run: refused by job and key
    unbudgeted = sweep_file(tmp_path, corpus_file, cache_dir, sweep="",
                            grid='"model.preset" = ["tiny", "mini"]', steps=2, extra="eval_interval = 0")
    with pytest.raises(StratumError, match=r"holds this sweep run with other settings: job j001's "
                                           r"offload.device_budget was '6MB', is now '' \(the sweep file or its "
                                           r"sweep.base file changed\)"):
        open_sweep(unbudgeted, say=lambda line: None)


def test_an_auto_slot_budget_leaves_every_job_as_it_is(tmp_path, corpus_file, cache_dir):
    # "auto" is no budget (parse_budget: None): nothing is compared against it, nothing moves to offload
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep='device_budget = "auto"',
                      grid='"model.preset" = ["tiny"]', steps=4)
    sweep = open_sweep(path, say=lambda line: None)
    assert all(cfg.train.engine == "plain" for cfg in sweep.configs.values())


def test_lrtf_slices_by_pausing_workers_keep_state_in_memory_and_parity(tmp_path, corpus_file, cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir,
                      sweep='scheduler = "lrtf"\nsegment_steps = 20\nslice_by = "pause"',
                      grid='"train.steps" = [120, 240]\n"optim.lr" = [1e-3, 3e-3]', steps=120,
                      extra="eval_interval = 0")  # slices that outlast the loop's polls on a fast machine
    lines, got = run_and_read(path)
    assert all(r["status"] == "done" for r in got.values()), (got, lines)
    assert any(": paused at step" in ln for ln in lines) and any(": continued on slot" in ln for ln in lines)
    # a worker stops itself at a slice's end (SliceGate), never past it, and never at its job's end
    paused = [(ln.split(":")[0], int(ln.split("paused at step ")[1].split(",")[0])) for ln in lines
              if ": paused at step" in ln]
    assert all(step % 20 == 0 and step < got[job]["steps"] for job, step in paused), paused
    for job_id in got:
        assert sum(ln.startswith(f"{job_id}: started") for ln in lines) == 1  # one process for the whole job
        ckpts = sorted(p.name for p in (tmp_path / "sw" / "jobs" / job_id / "checkpoints").glob("step_*"))
        assert ckpts == [f"step_{got[job_id]['steps']:08d}"]  # no checkpoint between slices
        assert job_losses(tmp_path / "sw", job_id) == standalone_losses(path, job_id, tmp_path / job_id)


def test_a_spent_time_budget_stops_running_and_paused_workers_with_a_checkpoint_each(tmp_path, corpus_file,
                                                                                       cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir,
                      sweep='scheduler = "lrtf"\nsegment_steps = 3\nslice_by = "pause"',
                      grid='"optim.lr" = [1e-3, 2e-3, 3e-3]', steps=2000, extra="eval_interval = 0")

    def spend_the_budget_once_a_worker_is_paused(sweep) -> None:
        # the budget is spent (set to a nanosecond) only once one worker is paused and two train: the stop then
        # meets both kinds, whatever this machine's speed
        trained = [read_metrics(sweep.dir / "jobs" / seg.job) for seg in sweep.running.values()]
        if sweep.resident and len(trained) == 2 and all(trained):
            sweep.spec.settings.time_budget_s = 1e-9

    lines, got = run_and_read(path, tick=spend_the_budget_once_a_worker_is_paused)
    assert any(ln.startswith("time budget of 1e-09 s spent") for ln in lines), lines
    assert all(r["status"] == "pending" and 0 < r["step"] < 2000 for r in got.values()), (
        [(r["id"], r["status"], r["step"]) for r in got.values()], lines)
    # an unfinished sweep has no measured makespan
    assert json.loads((tmp_path / "sw" / "makespan.json").read_text())["measured_s"] is None
    assert lines[-1].startswith("makespan: not measured yet")
    for job_id, r in got.items():  # each stopped after its step in progress, with a checkpoint there
        assert (tmp_path / "sw" / "jobs" / job_id / "checkpoints" / f"step_{r['step']:08d}").is_dir(), (
            job_id, r["step"], sorted(p.name for p in (tmp_path / "sw" / "jobs" / job_id / "checkpoints").iterdir()), lines)
        assert r["pid"] is None or not pid_alive(r["pid"])


def test_a_hung_worker_is_killed_after_the_stall_timeout_and_its_job_retried(tmp_path, corpus_file, cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep="stall_timeout_s = 2.0",
                      grid='"optim.lr" = [3e-3]', steps=30, extra="eval_interval = 0\nckpt_interval = 5")
    hung: list[int] = []

    def hang_the_first_worker_midway(sweep) -> None:
        seg = sweep.running.get(0)
        if not hung and seg is not None and len(read_metrics(sweep.dir / "jobs" / seg.job)) >= 6:
            os.kill(seg.worker.pid, signal.SIGSTOP)  # alive, holding its slot, making no progress
            hung.append(seg.worker.pid)

    lines, got = run_and_read(path, tick=hang_the_first_worker_midway)
    assert hung and not pid_alive(hung[0])
    assert got["j000"]["status"] == "done" and got["j000"]["attempts"] == 1
    assert any(ln.startswith("j000: failed: no step for 2 s: killed as hung") for ln in lines), lines
    assert job_losses(tmp_path / "sw", "j000") == standalone_losses(path, "j000", tmp_path)


@pytest.mark.parametrize("kind", ["forked", "launched"])
def test_the_loop_wakes_when_a_worker_ends_not_at_its_next_poll(kind, tmp_path):
    """A slot is refilled as soon as its worker ends: the loop's wait returns then (a forked worker's sentinel, a
    launched one's pidfd), long before the timeout it would otherwise sleep out."""
    if kind == "forked":
        worker = start_process(time.sleep, (0.3,), "stratum-test-sleep")
    else:
        worker = LaunchedWorker(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"]))
    assert worker.sentinel is not None
    seg = Segment(job="j000", slot=0, start_step=0, stop_at=1, worker=worker, log_path=tmp_path / "log",
                  started=time.monotonic())
    t0 = time.monotonic()
    wait_for_an_end(SimpleNamespace(running={0: seg}), 60.0)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 30.0
    worker.join(10.0)
    assert worker.poll() == 0

