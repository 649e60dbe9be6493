"""Benchmark: parallel plans against the plain engine on this machine, measured (not simulated).

Four studies, each writing JSON to ``benchmarks/results/``:

- ``plans``: every plan against plain on the same model, global batch and total threads: tokens/s per step
  (median) and peak RSS per rank. On 2 cores no plan can be faster than plain; the point is the overhead
  (goal: ``replicate(2)`` ≥ 0.9× plain at equal total threads).
- ``balance``: ``replicate(2)`` with process 1 throttled to a share of a core by a cgroup CPU quota (Linux cgroup
  v1 ``cpu.cfs_quota_us``, as a slower device would be): even shares against shares from the speeds measured
  at start-up (``parallel.speeds = auto``); goal ≥ 1.3×.
- ``offload``: the offload leaf alone, under ``replicate(2, …)``, ``pipeline(2, …)``, both, and ``split(2, …)``,
  each device under ``--budget`` (``--only PLAN``, repeatable: those plans instead, any budgets), against plain
  (the memory engine's overhead, and what the parallel nodes add to it).
- ``shard``: per-rank AdamW state bytes of ``replicate(4, shard=true)`` against ``replicate(4)`` (≈ 1/4).

Runbook::

    python benchmarks/parallel_bench.py plans   [--preset mini --steps 12 --rounds 3]
    python benchmarks/parallel_bench.py offload [--budget 50% --micro-batch 2]
    python benchmarks/parallel_bench.py balance [--quota 0.25 --rounds 3]
    python benchmarks/parallel_bench.py shard   [--preset small]

Each run is a fresh set of processes started by ``stratum run`` (plain: one process with all threads); every
rank writes its own measurements, the launcher collects them. Runs alternate between sides, the ratio is the
median of the per-round ratios. ``--baseline-src DIR`` runs each plan of ``plans``/``offload`` on another
checkout's code too, beside this one's in every round (before/after a change: ``ratio_vs_baseline``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stratum.ir.plan import parse_plan

HERE = Path(__file__).resolve().parent
CGROUP = Path("/sys/fs/cgroup/cpu/stratum-bench-throttle")


# ---- a rank: train a few steps on a plan, write what it measured -----------------------------------------------
def worker(a: argparse.Namespace) -> None:
    import torch

    import stratum
    from stratum.config import load_config
    from stratum.data.prepare import prepare_data
    from stratum.data.tokens import TRAIN
    from stratum.model.build import build_model
    from stratum.runtime.device import peak_rss_bytes

    rank = int(os.environ.get("RANK", "0"))
    if a.throttle_rank == rank:
        _throttle_self(a.quota)
    torch.set_num_threads(a.threads)
    cfg = load_config(None, [f"model.preset={a.preset!r}", f"data.seq_len={a.seq_len}",
                             f"data.cache_dir={a.cache_dir!r}", f"train.micro_batch_size={a.micro_batch}"])
    data = prepare_data(cfg)
    model = build_model(cfg.model, tokenizer_vocab=data.tokenizer.vocab_size, seq_len=a.seq_len, seed=0)
    engine = stratum.parallelize(model, plan=a.plan, lr=1e-4, micro_batches=a.micro_batches,
                                 timeout_s=300.0, speeds=a.speeds, batch_shape=(a.micro_batch, a.seq_len))
    total = a.micro_batches * engine.world.plan.replicas
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        mbs = data.sampler.micro_batches(TRAIN, step, a.micro_batch, total)
        x, y = torch.cat([b.x for b in mbs]), torch.cat([b.y for b in mbs])
        t0 = time.perf_counter()
        losses.append(engine.step(x, y))
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    stats = engine.engine.memory_stats()
    out = {"rank": rank, "plan": a.plan, "step_s": times, "median_step_s": statistics.median(times),
           "tokens_per_step": total * a.micro_batch * a.seq_len, "losses": losses, "peak_rss": peak_rss_bytes(),
           "optim_state_bytes": stats.get("optim_state_bytes"), "describe": engine.engine.describe(),
           "offload_device_peak_bytes": stats.get("offload_device_peak_bytes")}
    Path(a.out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    engine.close()


def _throttle_self(quota: float) -> None:
    """Put this process in a cgroup limited to ``quota`` of one core (cfs quota per 100 ms period)."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.cfs_period_us").write_text("100000")
    (CGROUP / "cpu.cfs_quota_us").write_text(str(int(quota * 100000)))
    (CGROUP / "cgroup.procs").write_text(str(os.getpid()))


# ---- the launcher ---------------------------------------------------------------------------------------------------
def run(plan: str, nproc: int, *, threads: int, a: argparse.Namespace, extra: list[str] = (),
        src: str = "") -> list[dict]:
    """``plan``'s processes, each with ``threads`` threads, running the ``stratum`` package under ``src`` (another
    checkout's ``src/``) where one is given, this one's otherwise; every rank's measurements."""
    out_dir = Path(tempfile.mkdtemp(prefix="parbench-"))
    replicas = parse_plan(plan).replicas  # each replica takes its share of the global batch
    args = [str(Path(__file__).resolve()), "worker", "--plan", plan, "--preset", a.preset, "--seq-len",
            str(a.seq_len), "--micro-batch", str(a.micro_batch), "--micro-batches", str(a.micro_batches // replicas),
            "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(threads), "--cache-dir",
            a.cache_dir, "--out-dir", str(out_dir), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **({"PYTHONPATH": src} if src else {}))
    cmd = ([sys.executable, "-m", "stratum", "run", "--nproc", str(nproc), "--timeout-s", "300", *args]
           if nproc > 1 else [sys.executable, *args])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    if p.returncode != 0:
        raise SystemExit(f"{plan}: failed\n{p.stderr[-3000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def tokens_per_s(ranks: list[dict]) -> float:
    return ranks[0]["tokens_per_step"] / max(r["median_step_s"] for r in ranks)


PLANS = [("replicate(2)", 2), ("replicate(2, shard=true)", 2), ("replicate(2, reduce=adasum)", 2),
         ("pipeline(2)", 2), ("split(2)", 2), ("replicate(2, pipeline(2))", 4), ("pipeline(2, split(2))", 4)]


def offload_plans(budget: str) -> list[tuple[str, int]]:
    """The offload leaf alone, under replicate, under pipeline and under both, each device under ``budget``."""
    leaf = f"offload(device_budget={budget})"
    return [(leaf, 1), (f"replicate(2, {leaf})", 2), (f"pipeline(2, {leaf})", 2),
            (f"replicate(2, pipeline(2, {leaf}))", 4), (f"split(2, {leaf})", 2)]


def study_plans(a: argparse.Namespace) -> dict:
    return compare(a, [(p, n) for p, n in PLANS if not a.only or p in a.only], "plans")


def study_offload(a: argparse.Namespace) -> dict:
    plans = (offload_plans(a.budget) if not a.only else
             [(p, parse_plan(p).world_size()) for p in a.only])
    return compare(a, plans, "offload") | {"budget": a.budget}


def compare(a: argparse.Namespace, plans: list[tuple[str, int]], study: str) -> dict:
    """Every plan against plain, rounds alternating the order; the ratio is the median of per-round ratios."""
    rows: dict[str, dict] = {}
    sides = [(p, n, "") for p, n in plans]
    if a.baseline_src:  # each plan also on the baseline checkout's code, beside it in every round
        sides = [x for p, n in plans for x in ((p, n, str(Path(a.baseline_src, "src"))), (p, n, ""))]
    for rnd in range(a.rounds):
        order = [("local", 1, "")] + sides if rnd % 2 == 0 else sides[::-1] + [("local", 1, "")]
        for plan, n, src in order:
            ranks = run(plan, n, threads=max(1, a.threads // n), a=a, src=src)
            key = f"{plan} @ baseline" if src else plan
            r = rows.setdefault(key, {"processes": n, "tokens_per_s": [], "peak_rss_mib": [],
                                      "offload_device_peak_bytes": []})
            r["tokens_per_s"].append(tokens_per_s(ranks))
            r["peak_rss_mib"].append([x["peak_rss"] / 2**20 for x in ranks])
            r["offload_device_peak_bytes"].append([x.get("offload_device_peak_bytes") for x in ranks])
            print(f"round {rnd} {key:<28} {r['tokens_per_s'][-1]:>10,.0f} tok/s", flush=True)
    base = rows["local"]["tokens_per_s"]
    for r in rows.values():
        r["ratio_vs_plain"] = statistics.median(t / b for t, b in zip(r["tokens_per_s"], base))
        r["median_tokens_per_s"] = statistics.median(r["tokens_per_s"])
    for plan, _ in plans:
        if f"{plan} @ baseline" in rows:
            r, b = rows[plan], rows[f"{plan} @ baseline"]
            r["ratio_vs_baseline"] = statistics.median(t / x for t, x in zip(r["tokens_per_s"], b["tokens_per_s"]))
    return {"study": study, "preset": a.preset, "threads": a.threads, "micro_batch": a.micro_batch,
            "seq_len": a.seq_len, "micro_batches": a.micro_batches, "rows": rows,
            "baseline_src": a.baseline_src or None}


def study_balance(a: argparse.Namespace) -> dict:
    if not Path("/sys/fs/cgroup/cpu").is_dir():
        raise SystemExit("the balance study needs cgroup v1's cpu controller at /sys/fs/cgroup/cpu")
    res: dict[str, list] = {"even": [], "balanced": [], "describe": []}
    for rnd in range(a.rounds):
        for side in (("even", "balanced") if rnd % 2 == 0 else ("balanced", "even")):
            extra = ["--throttle-rank", "1", "--quota", str(a.quota)]
            plan = "replicate(2)"
            ranks = run(plan, 2, threads=1, a=a, extra=extra + (["--speeds", "auto"] if side == "balanced" else []))
            res[side].append(tokens_per_s(ranks))
            if side == "balanced":
                res["describe"].append(ranks[0]["describe"])
            print(f"round {rnd} {side:<9} {res[side][-1]:>10,.0f} tok/s", flush=True)
    ratio = statistics.median(b / e for b, e in zip(res["balanced"], res["even"]))
    return {"study": "balance", "preset": a.preset, "quota": a.quota, "micro_batches": a.micro_batches, **res,
            "ratio_balanced_vs_even": ratio}


def study_shard(a: argparse.Namespace) -> dict:
    out = {}
    for plan in ("replicate(4)", "replicate(4, shard=true)"):
        ranks = run(plan, 4, threads=1, a=a)
        out[plan] = [r["optim_state_bytes"] for r in ranks]
        print(plan, out[plan], flush=True)
    full, shard = out["replicate(4)"], out["replicate(4, shard=true)"]
    return {"study": "shard", "preset": a.preset, "per_rank_state_bytes": out,
            "ratio_per_rank": [s / f for s, f in zip(shard, full)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("study", choices=["plans", "offload", "balance", "shard", "worker"])
    ap.add_argument("--plan", default="local")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step over all replicas")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--quota", type=float, default=0.25, help="balance: the throttled process's share of a core")
    ap.add_argument("--throttle-rank", type=int, default=-1)
    ap.add_argument("--budget", default="50%", help="offload: each device's budget (a size or a percentage)")
    ap.add_argument("--only", action="append", default=[],
                    help="plans, offload: run only this plan beside plain (repeatable; plans: one of its plans; "
                         "offload: any plan, as the offload study writes them)")
    ap.add_argument("--baseline-src", default="",
                    help="plans, offload: also run each plan on the stratum checkout in this directory (another "
                         "commit's tree, e.g. `git archive main | tar -x -C DIR`), beside this one's in every "
                         "round: rows 'PLAN @ baseline'")
    ap.add_argument("--speeds", default="", help="worker: parallel.speeds ('auto' measures them)")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "stratum-bench-cache"))
    ap.add_argument("--out-dir")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.study == "worker":
        worker(a)
        return
    res = {"study": a.study, **{"plans": study_plans, "offload": study_offload, "balance": study_balance,
                                 "shard": study_shard}[a.study](a),
           "argv": sys.argv[1:], "cpu_count": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(a.out or HERE / "results" / f"parallel_{a.study}.json")
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
