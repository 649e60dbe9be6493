"""Benchmark: the host memory a plan over the memory engine needs to build, train and checkpoint a model, measured.

Each plan is trained for ``--steps`` steps by ``stratum train`` (its ranks forked by the launcher, as a user runs
it) under the budgets its offload leaf gives, the rest of the training state on the disk tier under
``--disk-dir``, and a checkpoint written at the end. Figures: the largest process's peak resident memory, polled
from /proc every 0.2 s, all of it and its anonymous part (file pages a process maps belong to the page cache,
which the kernel takes back first), and rank 0's own peak from ``summary.json``. Beside every plan, in the same
round: the same plan on another checkout's code (``--baseline-src DIR``: before/after a change), and the printed
size of the model's whole training state in fp32 (parameters, gradients, AdamW moments).

Runbook::

    git archive <rev> | tar -x -C /tmp/stratum-old    # the code to compare with
    python benchmarks/build_memory_bench.py --baseline-src /tmp/stratum-old [--preset gpt2-355m --rounds 1 \
        --plans 'offload(…)' 'pipeline(2, offload(…))' 'split(2, offload(…))']

Writes ``benchmarks/results/build_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# budgets near the smallest each plan's ranks fit at gpt2-355m, 1 × 64 tokens, 2 micro-batches: the rest of a
# rank's training state goes to disk
PLANS = ["offload(device_budget=800MB, host_budget=400MB)",
         "pipeline(2, offload(device_budget=800MB, host_budget=400MB))",
         "split(2, offload(device_budget=800MB, host_budget=400MB))"]


def train(plan: str, a: argparse.Namespace, out: Path, src: str) -> dict:
    """``plan`` trained by ``stratum train`` on the code under ``src`` (this checkout's where empty), its
    processes' resident memory polled from /proc: the largest process's peak, all of it and its anonymous part
    (file pages a process maps are the page cache's, which the kernel takes back before it runs out)."""
    sets = [f"model.preset={a.preset!r}", f"data.seq_len={a.seq_len}", "train.micro_batch_size=1",
            "train.grad_accum=2", f"train.steps={a.steps}", "train.eval_interval=0", "train.ckpt_interval=0",
            f"data.cache_dir={a.cache_dir!r}", f"offload.disk_dir={a.disk_dir!r}", f"train.out_dir={str(out)!r}",
            f"parallel.plan={plan!r}"]
    argv = [sys.executable, "-m", "stratum", "train"] + [x for s in sets for x in ("--set", s)]
    if a.as_limit:  # running out of memory is then an allocation error, not the kernel's OOM killer
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        argv = ["prlimit", f"--as={int(ram * a.as_limit)}", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", **({"PYTHONPATH": src} if src else {}))
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        peak: dict[int, tuple[int, int]] = {}
        while p.poll() is None:
            for pid in descendants(p.pid):
                rss, anon = memory_kib(pid)
                old = peak.get(pid, (0, 0))
                peak[pid] = (max(old[0], rss), max(old[1], anon))
            time.sleep(0.2)
    got = {"peak_rss_mib": max(r for r, _ in peak.values()) / 1024,
           "peak_anon_mib": max(x for _, x in peak.values()) / 1024, "wall_s": time.perf_counter() - t0,
           "exit_code": p.returncode}
    if p.returncode != 0:  # (a run the kernel killed for memory is a result too: its peak so far stands)
        got["error"] = out.with_suffix(".log").read_text()[-400:]
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        return got
    summary = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out / "checkpoints")  # (gigabytes each: the runs would fill the disk)
    return {**got, "summary_peak_mib": summary["peak_device_bytes"] / 2**20, "final_loss": summary.get("final_loss")}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the launcher, its forkserver, the ranks), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], [pid]
    while todo:
        q = todo.pop()
        found.append(q)
        todo += children.get(q, [])
    return found


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of ``pid`` in KiB; zeros once it has gone."""
    try:
        fields = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
    except OSError:
        return 0, 0
    return (int(fields.get("VmRSS", "0 kB").split()[0]), int(fields.get("RssAnon", "0 kB").split()[0]))


def state_mib(preset: str) -> float:
    """The model's whole training state in fp32 (parameters, gradients, two AdamW moments), MiB."""
    from stratum.config import load_config
    from stratum.model.build import build_model

    cfg = load_config(None, [f"model.preset={preset!r}"])
    meta = build_model(cfg.model, tokenizer_vocab=50257, seq_len=64, seed=0, device="meta")
    return 16 * meta.num_params() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-355m")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--plans", nargs="+", default=PLANS)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--as-limit", type=float, default=0.0,
                    help="limit every run's address space to this fraction of RAM (prlimit), e.g. 0.9")
    ap.add_argument("--baseline-src", default="", help="another checkout (its src/ is used) run beside this one")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "stratum-bench-cache"))
    ap.add_argument("--disk-dir", default=str(Path(tempfile.gettempdir()) / "stratum-build-memory"))
    ap.add_argument("--out", default=str(HERE / "results" / "build_memory.json"))
    a = ap.parse_args()
    Path(a.disk_dir).mkdir(parents=True, exist_ok=True)
    plans = a.plans
    sides = [("this", "")] + ([("baseline", str(Path(a.baseline_src, "src")))] if a.baseline_src else [])
    work = Path(tempfile.mkdtemp(prefix="build-memory-"))
    runs: dict[str, dict[str, list[dict]]] = {p: {s: [] for s, _ in sides} for p in plans}
    for r in range(a.rounds):
        for plan in plans:
            for side, src in sides if r % 2 == 0 else sides[::-1]:
                got = train(plan, a, work / f"r{r}-{len(runs[plan][side])}-{side}-{abs(hash(plan))}", src)
                runs[plan][side].append(got)
                print(f"round {r} {side:<8} {plan}: peak {got['peak_rss_mib']:,.0f} MiB resident, "
                      f"{got['peak_anon_mib']:,.0f} MiB anonymous ({got['wall_s']:.0f} s, exit {got['exit_code']})",
                      flush=True)
    whole = state_mib(a.preset)
    rows = {p: {side: {"peak_rss_mib": statistics.median(x["peak_rss_mib"] for x in v),
                       "peak_anon_mib": statistics.median(x["peak_anon_mib"] for x in v), "runs": v}
                for side, v in by_side.items()} for p, by_side in runs.items()}
    result = {"benchmark": "build_memory", "preset": a.preset, "state_mib_whole_model": whole,
              "steps": a.steps,
              "baseline_src": a.baseline_src or None, "rows": rows, "argv": sys.argv[1:],
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{a.preset}: whole training state {whole:,.0f} MiB (fp32), half of it {whole / 2:,.0f} MiB")
    for p, by_side in rows.items():
        print(f"{p}: " + ", ".join(f"{s} {v['peak_rss_mib']:,.0f} MiB ({v['peak_anon_mib']:,.0f} anonymous)"
                                   for s, v in by_side.items()))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
