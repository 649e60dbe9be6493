"""Benchmark: multiplexing — a background job beside a foreground job on this machine, measured.

Four runs per round, every one a real ``stratum train`` (fresh processes):

1. the foreground alone: on the CPU ``burst(2, widths=…)`` on GPT ``--fg-preset`` (its narrow blocks leave rank 1
   idle); with ``--device cuda`` the plain engine on the one GPU at ``train.priority = foreground`` (its kernels
   on a stream of the highest priority);
2. the background alone: the plain engine on GPT ``--bg-preset``, one process (on the GPU with ``--device cuda``);
3. both, the background at ``train.priority = background`` (SCHED_IDLE; on a GPU, the lowest stream priority);
4. both at normal priority (what the priorities buy).

The foreground starts first; the background is started right after and stopped when the foreground ends, so
every background step it logged overlapped the foreground. Per run: median step seconds (the first
``--skip`` steps of each job left out: start-up). Reported: the foreground's slowdown
(together / alone − 1; goal ≤ 10 %) and the background's throughput together as a fraction of alone (goal
≥ 30 %), medians over rounds. JSON in ``benchmarks/results/multiplex.json`` (``multiplex_cuda.json``).

Stream priorities order the kernels of one CUDA context: two processes on one GPU share one only under MPS (the
multi-process service); without it the GPU time-slices between them and no priority crosses. The JSON records
whether an MPS control daemon was seen (its pipe directory's pid file).

Runbook::

    python benchmarks/multiplex_bench.py [--rounds 2 --fg-steps 40 --fg-preset mini --bg-preset tiny]
    python benchmarks/multiplex_bench.py --device cuda --fg-preset small --bg-preset mini --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def corpus(d: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = d / "corpus.txt"
    path.write_text("\n".join((stdlib / n).read_text() for n in ("argparse.py", "dataclasses.py", "textwrap.py",
                                                                "difflib.py")))
    return path


def sets(args, d: Path, out: str, preset: str, steps: int, *extra: str) -> list[str]:
    return [f"data.corpus={str(d / 'corpus.txt')!r}", f"data.cache_dir={str(d / 'cache')!r}",
            f"data.seq_len={args.seq_len}", f"model.preset={preset!r}", f"train.micro_batch_size={args.batch}",
            f"train.steps={steps}", "train.eval_interval=0", "train.eval_batches=1", "optim.warmup_steps=2",
            "train.ckpt_interval=0", "train.ckpt_minutes=0", f"train.out_dir={str(d / out)!r}", *extra]


def start(s: list[str], log: Path | None = None) -> subprocess.Popen:
    """``stratum train`` with ``s`` (one thread per process), its own process group; stdout to ``log``."""
    argv = [sys.executable, "-m", "stratum", "train"]
    for x in s:
        argv += ["--set", x]
    stdout = log.open("w") if log is not None else subprocess.DEVNULL
    return subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def step_times(out: Path, skip: int) -> list[float]:
    rows = []
    path = out / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut off when the job was stopped
    return [r["step_s"] for r in rows if "step_s" in r][skip:]


def finish(p: subprocess.Popen, what: str) -> None:
    _, err = p.communicate(timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{what} failed (exit {p.returncode}):\n{err[-2000:]}")


def stop(p: subprocess.Popen) -> None:
    """Stop the background job (its process group: the launcher and any workers it started)."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=60)


def foreground_sets(args, d: Path, out: str, prio: str) -> list[str]:
    """The foreground job at ``prio``: a burst plan over 2 CPU processes, or the plain engine on the GPU."""
    if args.device == "cuda":
        return sets(args, d, out, args.fg_preset, args.fg_steps, "train.device='cuda'", f"train.priority={prio!r}")
    return sets(args, d, out, args.fg_preset, args.fg_steps, f"parallel.plan='burst(2, widths={args.widths})'",
                f"train.priority={prio!r}")


def background_sets(args, d: Path, out: str, steps: int, prio: str) -> list[str]:
    return sets(args, d, out, args.bg_preset, steps, f"train.device={args.device!r}", f"train.priority={prio!r}")


def one_round(args, d: Path, r: int) -> dict:
    fg_prio = "foreground" if args.device == "cuda" else "normal"  # on a CPU the OS's normal is the highest
    res = {}
    p = start(foreground_sets(args, d, f"fg{r}", fg_prio))
    finish(p, "the foreground alone")
    res["fg_alone_s"] = statistics.median(step_times(d / f"fg{r}", args.skip))
    p = start(background_sets(args, d, f"bg{r}", args.bg_steps, "normal"))
    finish(p, "the background alone")
    res["bg_alone_s"] = statistics.median(step_times(d / f"bg{r}", args.skip))
    for prio in ("background", "normal"):
        fg = start(foreground_sets(args, d, f"fg{r}_{prio}", fg_prio if prio == "background" else "normal"))
        bg = start(background_sets(args, d, f"bg{r}_{prio}", 100000, prio))
        try:
            finish(fg, f"the foreground beside a {prio} background")
        finally:
            stop(bg)
        res[f"fg_with_{prio}_s"] = statistics.median(step_times(d / f"fg{r}_{prio}", args.skip))
        bg_steps = step_times(d / f"bg{r}_{prio}", args.skip)
        res[f"bg_{prio}_steps"] = len(bg_steps)
        res[f"bg_with_{prio}_s"] = statistics.median(bg_steps) if bg_steps else float("inf")
    return res


def mps_daemon() -> bool:
    """Whether an MPS control daemon runs for this user: its pid file in the pipe directory clients would use."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return (pipe / "nvidia-cuda-mps-control.pid").exists()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fg-preset", default="mini")
    ap.add_argument("--bg-preset", default="tiny")
    ap.add_argument("--fg-steps", type=int, default=40)
    ap.add_argument("--bg-steps", type=int, default=30)
    ap.add_argument("--widths", default="2:1:1:1:1:2", help="the foreground's burst widths (one per block)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: both jobs on the one GPU, the foreground plain at train.priority = foreground")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON (default benchmarks/results/multiplex.json, multiplex_cuda.json with --device cuda)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        corpus(d)
        rounds = [one_round(args, d, r) for r in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    summary = {
        "fg_slowdown_with_background": med["fg_with_background_s"] / med["fg_alone_s"] - 1,
        "bg_fraction_as_background": med["bg_alone_s"] / med["bg_with_background_s"],
        "fg_slowdown_with_normal": med["fg_with_normal_s"] / med["fg_alone_s"] - 1,
        "bg_fraction_as_normal": med["bg_alone_s"] / med["bg_with_normal_s"],
    }
    out = {"args": vars(args), "rounds": rounds, "median": med, "summary": summary, "mps_daemon": mps_daemon(),
           "cores": len(os.sched_getaffinity(0)), "load_avg_at_end": os.getloadavg(), "time": time.time()}
    path = args.out or HERE / "results" / ("multiplex_cuda.json" if args.device == "cuda" else "multiplex.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    out["args"]["out"] = str(path)
    path.write_text(json.dumps(out, indent=2))
    fg = "plain, train.priority = foreground," if args.device == "cuda" else f"burst(2, widths={args.widths})"
    print(f"foreground {fg} {args.fg_preset}: {med['fg_alone_s']:.3f} s/step alone"
          + (f" (MPS control daemon: {'seen' if out['mps_daemon'] else 'not seen'})" if args.device == "cuda" else ""))
    print(f"background plain {args.bg_preset}: {med['bg_alone_s']:.3f} s/step alone")
    for prio in ("background", "normal"):
        print(f"together, background at {prio:>10} priority: foreground {med[f'fg_with_{prio}_s']:.3f} s/step "
              f"({100 * summary[f'fg_slowdown_with_{prio}']:+.1f} %), background {med[f'bg_with_{prio}_s']:.3f} "
              f"s/step ({100 * summary[f'bg_fraction_as_{prio}']:.0f} % of alone)")


if __name__ == "__main__":
    main()
