"""Benchmark: the start-up of a multi-process ``stratum train``, ranks exec'd (``STRATUM_SPAWN=exec``: a fresh
``python`` per rank, each importing torch) against ranks forked from the warm forkserver (the default on Linux).

The ``stratum train`` runs get this process's environment (without ``OMP_NUM_THREADS``, the launcher gives each
rank its share of the cores); the pytest runs get ``OMP_NUM_THREADS=1`` as the suite is run. Each round runs
every plan once per mode, the modes alternating, and records the wall time and the CPU time of the
whole process tree (this process is the tree's subreaper, so the forkserver and the ranks it forked are counted
when they end). Optionally (``--pytest``) it times the same pytest command once per mode, also alternating.

Runbook::

    flock /tmp/stratum-bench.lock python benchmarks/startup_bench.py            # ≈ 3 minutes on 2 cores
    flock /tmp/stratum-bench.lock python benchmarks/startup_bench.py --pytest   # + the two pytest files, twice

Writes ``benchmarks/results/startup.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stratum.atomic import atomic_write_json

PLANS = ("replicate(2)", "pipeline(2, split(2))")
MODES = ("exec", "fork")
PYTEST = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
          "tests/test_parallel_replicate.py", "tests/test_parallel_split_offload.py"]
_PR_SET_CHILD_SUBREAPER = 36


def train_argv(plan: str, corpus: str, out_dir: Path) -> list[str]:
    sets = ["model.preset='tiny'", "data.seq_len=32", "train.micro_batch_size=4", "train.steps=10",
            "train.grad_accum=2", f"parallel.plan='{plan}'", f"data.corpus='{corpus}'", f"train.out_dir='{out_dir}'"]
    return ["-m", "stratum", "train", *[a for s in sets for a in ("--set", s)]]


def load() -> float:
    return os.getloadavg()[0]


def timed(argv: list[str], mode: str, **env_extra: str) -> dict:
    """Run ``python argv`` in ``mode``; wall and CPU seconds of it and every process it left behind."""
    env = dict(os.environ, STRATUM_SPAWN=mode, **env_extra)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0, load0 = time.perf_counter(), load()
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    while True:  # orphans (the forkserver, the resource tracker) are ours to reap: their CPU counts
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_before": load0, "load_after": load()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--corpus", default=str(Path(json.__file__).parent), help="text files to train on")
    ap.add_argument("--pytest", action="store_true", help="also time the two test files once per mode")
    ap.add_argument("--out", default="benchmarks/results/startup.json")
    args = ap.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    runs: dict[str, dict[str, list[dict]]] = {p: {m: [] for m in MODES} for p in PLANS}
    with tempfile.TemporaryDirectory() as tmp:
        for plan in PLANS:  # untimed: the data cache, the page cache
            timed(train_argv(plan, args.corpus, Path(tmp) / f"warm-{plan}"), "exec")
        for i in range(args.rounds):
            for plan in PLANS:
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    r = timed(train_argv(plan, args.corpus, Path(tmp) / f"{plan}-{mode}-{i}"), mode)
                    runs[plan][mode].append(r)
                    print(f"{plan:24s} {mode:5s} wall {r['wall_s']:6.2f} s  cpu {r['cpu_s']:6.2f} s  "
                          f"load {r['load_before']:.2f}", flush=True)
        pytest = {mode: timed(PYTEST, mode, OMP_NUM_THREADS="1") for mode in MODES} if args.pytest else {}
    result = {"command": "python benchmarks/startup_bench.py" + (" --pytest" if args.pytest else ""),
              "cpus": os.cpu_count(), "runs": runs, "pytest": pytest, "median": {}}
    for plan in PLANS:
        med = {m: {k: statistics.median(r[k] for r in runs[plan][m]) for k in ("wall_s", "cpu_s")} for m in MODES}
        med["ratio_wall"] = round(med["exec"]["wall_s"] / med["fork"]["wall_s"], 2)
        med["ratio_cpu"] = round(med["exec"]["cpu_s"] / med["fork"]["cpu_s"], 2)
        result["median"][plan] = med
        print(f"{plan}: median {med}")
    for mode, r in pytest.items():
        print(f"pytest {mode}: wall {r['wall_s']} s, cpu {r['cpu_s']} s, load {r['load_before']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
