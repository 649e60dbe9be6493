"""Benchmark: burst plans against plain and data parallelism on this machine, measured, with the planner's
prediction beside the measurement.

Per round, real ``stratum train`` runs on the same global batch (``--batch`` sequences per step):

- ``local``: the plain engine, one process (one thread: every process here runs one, since two threads in one
  process on a shared 2-core machine run several times slower — see stratum/train/threads.py);
- ``replicate(2)``: data parallel, ``--batch / 2`` sequences per replica — DeepPool's baseline;
- ``burst(2)``: widths planned at start (quick profile + the measured link), ``--batch`` split per block;
- ``burst(2, widths=…)``: the hand widths ``--widths``.

Reported per plan: median step seconds (first ``--skip`` steps left out), the speed relative to
``replicate(2)``, and for the planned burst its predicted step seconds (``summary.json``) over the measured. Plans alternate within a round;
medians over rounds. JSON in ``benchmarks/results/burst.json``.

Runbook::

    python benchmarks/burst_bench.py [--rounds 2 --steps 20 --preset mini --batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from multiplex_bench import HERE, corpus, finish, start, step_times


def run(args, d: Path, name: str, plan: str, batch: int) -> dict:
    out = d / name
    s = [f"data.corpus={str(d / 'corpus.txt')!r}", f"data.cache_dir={str(d / 'cache')!r}",
         f"data.seq_len={args.seq_len}", f"model.preset={args.preset!r}", f"train.micro_batch_size={batch}",
         f"train.steps={args.steps}", "train.eval_interval=0", "train.eval_batches=1", "optim.warmup_steps=2",
         "train.ckpt_interval=0", "train.ckpt_minutes=0", f"train.out_dir={str(out)!r}", f"parallel.plan={plan!r}",
         "train.threads=1"]
    log = d / f"{name}.log"
    finish(start(s, log), plan)
    summary = json.loads((out / "summary.json").read_text())
    lines = log.read_text().splitlines()
    table = [x for x in lines if x.startswith("block  width") or x.strip()[:1].isdigit() and len(x.split()) == 6
             or x.startswith("step ") and "device-s" in x]
    return {"step_s": statistics.median(step_times(out, args.skip)),
            "predicted_step_s": summary.get("predicted_step_s"), "plan_table": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--widths", default="2:2:2:1:1:1")
    ap.add_argument("--skip", type=int, default=3)
    args = ap.parse_args()
    # (plan, micro-batch): the same global batch everywhere
    plans = {"local": ("local", args.batch), "replicate(2)": ("replicate(2)", args.batch // 2),
             "burst(2) planned": ("burst(2)", args.batch),
             f"burst(2, widths={args.widths})": (f"burst(2, widths={args.widths})", args.batch)}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        corpus(d)
        for r in range(args.rounds):
            order = list(plans) if r % 2 == 0 else list(plans)[::-1]
            rounds.append({name: run(args, d, f"r{r}_{i}", *plans[name]) for i, name in enumerate(order)})
    med = {name: statistics.median(r[name]["step_s"] for r in rounds) for name in plans}
    pred = [r["burst(2) planned"]["predicted_step_s"] for r in rounds]
    summary = {name: {"step_s": med[name], "speed_vs_replicate": med["replicate(2)"] / med[name]} for name in plans}
    summary["burst(2) planned"]["predicted_over_measured"] = statistics.median(pred) / med["burst(2) planned"]
    out = {"args": vars(args), "rounds": rounds, "summary": summary, "cores": len(os.sched_getaffinity(0)),
           "load_avg_at_end": os.getloadavg(), "time": time.time()}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "burst.json").write_text(json.dumps(out, indent=2))
    print("the planned widths (last round):", *rounds[-1]["burst(2) planned"]["plan_table"], sep="\n")
    for name, s in summary.items():
        extra = f", predicted/measured {s['predicted_over_measured']:.2f}" if "predicted_over_measured" in s else ""
        print(f"{name:<28} {s['step_s']:.3f} s/step  {s['speed_vs_replicate']:.2f}x replicate(2){extra}")


if __name__ == "__main__":
    main()
