"""Benchmark: what the lock over torch's global generators (``stratum.model.streams.GLOBAL_RNG``) costs.

Two parts, each with the lock and without it side by side in one run (without it is only a cost reference:
concurrent threads would draw each other's masks):

1. **Single process** (every engine outside the sharded-lrtf worker): one ``block_stream`` (fork, seed, put back)
   per block forward; the lock adds an uncontended RLock acquire and release to each. Measured as µs per
   acquire and release, µs per ``block_stream`` and as the step time of a plain-engine step of ``--preset`` with dropout 0.1.
2. **sharded-lrtf worker, 2 slots**: two jobs with dropout (their block forwards exclusive under the lock, and
   a job's set-up excludes the others' forwards) — the shard worker's makespan with the lock and without; and two
   jobs without dropout (their threads fork nothing, so the lock is never taken) for reference.

Medians of ``--repeats`` runs, alternating. Runbook::

    flock /tmp/stratum-bench.lock python benchmarks/shard_dropout_lock.py
    python benchmarks/shard_dropout_lock.py --repeats 1 --steps 2 --out /tmp/lock.json   # a quick look

Writes ``benchmarks/results/shard_dropout_lock.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from stratum.atomic import atomic_write_text
from stratum.model import streams
from stratum.model.gpt import build_gpt
from stratum.sweep.runner import open_sweep
from stratum.sweep.setup import write_job_configs
from stratum.sweep.shard_worker import ShardJob, run_shard_jobs

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def lock_removed() -> Iterator[None]:
    """``block_stream``'s forks without the lock (what they cost before it)."""
    lock = streams.GLOBAL_RNG
    streams.GLOBAL_RNG = contextlib.nullcontext()  # type: ignore[assignment]
    try:
        yield
    finally:
        streams.GLOBAL_RNG = lock


def paired(fn: Callable[[], float], repeats: int) -> dict:
    """Median of ``fn`` with the lock and without it, alternating."""
    locked, free = [], []
    for _ in range(repeats):
        locked.append(fn())
        with lock_removed():
            free.append(fn())
    a, b = statistics.median(locked), statistics.median(free)
    return {"with_lock": a, "without_lock": b, "ratio": a / b, "runs_with": locked, "runs_without": free}


def stream_us(n: int = 20_000) -> float:
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    for k in range(n):
        with streams.block_stream(12345, k % 12, cpu):
            pass
    return (time.perf_counter() - t0) / n * 1e6


def lock_us(n: int = 200_000) -> float:
    """One uncontended acquire and release of the lock, less the loop's own time."""
    lock = streams.GLOBAL_RNG
    t0 = time.perf_counter()
    for _ in range(n):
        with lock:
            pass
    t1 = time.perf_counter()
    for _ in range(n):
        pass
    return ((t1 - t0) - (time.perf_counter() - t1)) / n * 1e6


def step_ms_fn(preset: str) -> Callable[[], float]:
    model = build_gpt(preset, vocab_size=256, seed=0, dropout=0.1)
    model.train()
    x = torch.randint(0, 256, (4, 64))

    def step() -> float:
        t0 = time.perf_counter()
        for i in range(5):
            model.loss(x, x, stream=i).backward()
        return (time.perf_counter() - t0) / 5 * 1e3
    step()  # warm
    return step


def sweep_file(root: Path, dropout: float, steps: int, preset: str) -> Path:
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    path = root / f"sweep_d{dropout}.toml"
    path.write_text(f"""[sweep]
out_dir = "{root / f'sw_d{dropout}'}"
slots = 2
scheduler = "sharded-lrtf"
device_budget = "6MB"
shard_blocks = 2
[sweep.grid]
"optim.lr" = [1e-3, 3e-3]
"model.dropout" = [{dropout}]
[model]
preset = "{preset}"
[data]
corpus = "{corpus}"
cache_dir = "{root / 'cache'}"
seq_len = 64
[train]
steps = {steps}
micro_batch_size = 4
eval_interval = 0
ckpt_minutes = 0.0
""")
    return path


def makespan_fn(root: Path, dropout: float, steps: int, preset: str) -> Callable[[], float]:
    """One shard worker over the sweep's 2 jobs, in this process, in a fresh copy of their directories."""
    sweep = open_sweep(sweep_file(root, dropout, steps, preset), say=lambda _: None)
    write_job_configs(sweep)
    runs = iter(range(1_000))

    def run() -> float:
        d = root / f"run_d{dropout}_{next(runs)}"
        shutil.copytree(sweep.dir, d)
        jobs = []
        for job_id in sweep.configs:
            toml = d / "jobs" / job_id / "job.toml"
            toml.write_text(toml.read_text().replace(str(sweep.dir), str(d)))
            jobs.append(ShardJob(id=job_id, config_path=str(toml), tasks_left=1, task_s=1.0, shard_blocks=2))
        t0 = time.perf_counter()
        codes = run_shard_jobs(jobs, slots=2, threads=1, sweep_dir=d)
        assert set(codes.values()) == {0}, codes
        return time.perf_counter() - t0
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--out", default=str(HERE / "results" / "shard_dropout_lock.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    out: dict = {"command": "python benchmarks/shard_dropout_lock.py", "args": vars(args),
                 "load_average": os.getloadavg(), "torch_threads": 1}
    out["lock_us"] = statistics.median(lock_us() for _ in range(5))
    out["block_stream_us"] = paired(stream_us, max(args.repeats, 5))
    out["plain_step_ms"] = paired(step_ms_fn(args.preset), max(args.repeats, 5))
    with tempfile.TemporaryDirectory() as tmp:
        out["shard_worker_dropout_s"] = paired(makespan_fn(Path(tmp), 0.1, args.steps, args.preset), args.repeats)
        quiet = makespan_fn(Path(tmp), 0.0, args.steps, args.preset)
        out["shard_worker_no_dropout_s"] = statistics.median(quiet() for _ in range(args.repeats))
    out["load_average_end"] = os.getloadavg()
    atomic_write_text(Path(args.out), json.dumps(out, indent=1))
    for k in ("block_stream_us", "plain_step_ms", "shard_worker_dropout_s"):
        v = out[k]
        print(f"{k}: with lock {v['with_lock']:.4g}, without {v['without_lock']:.4g}, ratio {v['ratio']:.3f}")
    print(f"shard_worker_no_dropout_s: {out['shard_worker_no_dropout_s']:.4g}; lock_us: {out['lock_us']:.3g}")
    print(f"load average {out['load_average']} → {out['load_average_end']}; wrote {args.out}")


if __name__ == "__main__":
    main()
