"""Benchmark: the offload engine side by side with the plain engine (one run, same model and batches).

Runbook::

    python benchmarks/offload_bench.py overhead      # budget ≥ training state: everything stays on the device
    python benchmarks/offload_bench.py offload       # device budget = 25% of the training state
    python benchmarks/offload_bench.py beyond-ram    # GPT-2 774M, RAM budgets adding up to 2 GB, rest on disk
    python benchmarks/offload_bench.py capacity      # largest preset each engine trains for 3 steps

``overhead`` and ``offload`` run both engines in one process on the same batches: by default the plain engine's
steps first, then the offload engine's (``--block N`` alternates blocks of N steps instead); the median step time
after warm-up gives tokens/s. Not alternating single steps, as earlier versions did: the offload engine's update
pass and prefetches run beside its *next* step, so alternation put them beside the plain engine's step instead,
flattering the offload engine and slowing the plain one (0.93-0.95x measured that way at a 25 % budget against
0.81-0.82x run one after the other). Even in blocks the plain engine ran 7-10 % slower once the offload engine's
threads had run in the process, hence plain first. Between blocks an engine's background work is drained, untimed,
and the first step of a later block (with none of it beside) is not timed. ``--processes N`` runs them instead
as a user would, each run of an engine in a fresh process of its own (the plain engine with glibc's default
allocator policy, the offload engine with its own), N rounds alternated; the ratio is the median of the rounds'
ratios. ``beyond-ram`` and ``capacity`` run every engine in its own process (peak RSS is that run's alone).
Results go to ``benchmarks/results/offload_<mode>.json``.

    python benchmarks/offload_bench.py offload --preset small --micro-batch 4 --seq-len 128 --steps 30 \
        --warmup 3 --processes 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _cfg(preset: str, micro: int, seq: int, extra=()):
    from stratum.config import load_config
    return load_config(None, [f"model.preset={preset!r}", f"data.seq_len={seq}", f"train.micro_batch_size={micro}",
                              *extra])


def _batches(cfg, steps):
    from stratum.data.prepare import prepare_data
    from stratum.data.tokens import TRAIN
    data = prepare_data(cfg)
    return [data.sampler.micro_batches(TRAIN, s, cfg.train.micro_batch_size, cfg.train.grad_accum)
            for s in range(steps)], data.tokenizer.vocab_size


def side_by_side(mode: str, preset: str, micro: int, seq: int, steps: int, warmup: int, device: str = "cpu",
                 extra=(), block: int = 0) -> dict:
    import torch

    from stratum.model.build import build_model
    from stratum.offload.engine import OffloadEngine
    from stratum.offload.setup import placement_for
    from stratum.runtime import optim_spec
    from stratum.runtime.device import describe as describe_device
    from stratum.runtime.device import resolve_device, synchronize
    from stratum.runtime.plain import PlainEngine

    cfg = _cfg(preset, micro, seq, extra)
    batches, vocab = _batches(cfg, steps + warmup)
    dev = resolve_device(device)
    model = build_model(cfg.model, tokenizer_vocab=vocab, seq_len=seq, seed=0)
    state = 16 * model.num_params()
    budget = "" if mode == "overhead" else str(state // 4)
    ocfg = _cfg(preset, micro, seq, [*extra, f"offload.device_budget={budget!r}"])
    t0 = time.perf_counter()
    plan = placement_for(ocfg, model, dev, always_profile=True)
    plan_s = time.perf_counter() - t0
    print(plan.describe(), flush=True)
    prec = cfg.train.precision
    plain = PlainEngine(copy.deepcopy(model), optim=optim_spec(cfg), device=dev, precision=prec)
    # The offload engine checks the GPU allocator's bytes against its budget (all of this process's bytes since
    # it was built): it is built after the plain engine's first step has allocated that engine's gradients and
    # optimizer state, which would otherwise count as the offload engine's.
    engines = {"plain": plain}
    times = {"plain": [], "offload": []}
    losses = {"plain": [], "offload": []}
    moved = []  # the offload engine's step_io() of each timed step
    order = ["plain", "offload"]
    block = block if block > 0 else len(batches)
    for lo in range(0, len(batches), block):
        for name in order:
            if name not in engines:
                engines[name] = OffloadEngine(model, optim=optim_spec(cfg), device=dev, placement=plan, precision=prec,
                                              check_every_step=True)
            eng = engines[name]
            for s in range(lo, min(lo + block, len(batches))):
                synchronize(dev)
                t = time.perf_counter()
                r = eng.train_step(batches[s], 1e-4)
                synchronize(dev)
                dt = time.perf_counter() - t
                losses[name].append(r.loss)
                if s >= warmup and (s > lo or lo == 0):
                    times[name].append(dt)
                    if name == "offload":
                        moved.append(eng.step_io())
                print(f"step {s} {name}: {dt:.3f}s", flush=True)
            if hasattr(eng, "drain"):
                eng.drain()
            synchronize(dev)
        order.reverse()
    off = engines["offload"]
    tokens = cfg.tokens_per_step
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "mode": mode, "preset": preset, "params": model.num_params(), "train_state_bytes": state,
        "device_budget_bytes": plan.device_budget, "tokens_per_step": tokens, "steps_timed": len(times["offload"]),
        "warmup_steps": warmup, "block_steps": block, "threads": torch.get_num_threads(),
        "device": describe_device(dev),
        "median_step_s": med, "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "ratio_offload_over_plain": med["plain"] / med["offload"],
        "losses_equal": losses["plain"] == losses["offload"],
        "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in zip(losses["plain"], losses["offload"])),
        "plan": plan.to_dict(), "plan_s": plan_s,
        "measured_peak_bytes": off.measured_peaks(), "fetches": off.n_fetches,
        "bytes_h2d": off.bytes_h2d, "bytes_d2h": off.bytes_d2h,
        "moved_per_step_median": {k: statistics.median(m[k] for m in moved) for k in moved[0]} if moved else {},
        "load_average": os.getloadavg(),
    }
    off.close()
    return out


def _worker(args) -> dict:
    """One engine, one process: ``steps`` steps of ``preset``; prints a JSON line."""
    import torch

    from stratum.model.build import build_model
    from stratum.parallel.compose import make_engine
    from stratum.runtime.device import peak_rss_bytes

    common = ["train.seed=0", f"optim.grad_clip={args.grad_clip}", *args.set]
    cfg = _cfg(args.preset, args.micro_batch, args.seq_len, common)
    batches, vocab = _batches(cfg, args.steps)
    t0 = time.perf_counter()
    # the offload engine builds the model block by block, as the trainer does
    model = build_model(cfg.model, tokenizer_vocab=vocab, seq_len=args.seq_len, seed=0,
                        lazy=args.engine == "offload")
    extra = [f"train.engine={args.engine!r}"]
    if args.engine == "offload":
        budget = args.device_budget
        if args.budget_fraction:  # of the training state: parameters, gradients and AdamW's two moments in fp32
            budget = str(int(args.budget_fraction * 16 * model.num_params()))
        extra += [f"offload.device_budget={budget!r}", f"offload.host_budget={args.host_budget!r}",
                  f"offload.disk_dir={args.disk_dir!r}"]
    cfg = _cfg(args.preset, args.micro_batch, args.seq_len, extra + common)
    engine = make_engine(cfg, model, torch.device("cpu"))
    del model
    setup_s = time.perf_counter() - t0
    times, losses, stalls, phases, moved = [], [], [], [], []
    for b in batches:
        t = time.perf_counter()
        s0 = getattr(engine, "stall_s", 0.0)
        p0 = dict(getattr(engine, "phase_s", {}))
        losses.append(engine.train_step(b, 1e-4).loss)
        times.append(time.perf_counter() - t)
        stalls.append(getattr(engine, "stall_s", 0.0) - s0)
        phases.append({k: v - p0[k] for k, v in getattr(engine, "phase_s", {}).items()})
        moved.append(engine.step_io())
        print(f"step {len(times)}: {times[-1]:.1f}s (waiting for chunks {stalls[-1]:.1f}s; phases "
              f"{ {k: round(v, 1) for k, v in phases[-1].items()} }) loss {losses[-1]:.4f} "
              f"rss peak {peak_rss_bytes() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    res = {"engine": args.engine, "preset": args.preset, "step_s": times, "stall_s": stalls, "phase_s": phases,
           "moved": moved,
           "losses": losses,
           "setup_s": setup_s,
           "peak_rss_bytes": peak_rss_bytes(), "tokens_per_step": cfg.tokens_per_step}
    if args.engine == "offload":
        res.update(plan=engine.placement.to_dict(), measured_peak_bytes=engine.measured_peaks(),
                   bytes_h2d=engine.bytes_h2d, bytes_d2h=engine.bytes_d2h)
        if args.probe_bandwidths:  # after the run, as the disk is then (beyond-ram's bound)
            from stratum.offload.tiers import measure_bandwidths
            res["bandwidths"] = measure_bandwidths(torch.device("cpu"), args.disk_dir or "/tmp").to_dict()
    engine.close()
    print("RESULT " + json.dumps(res), flush=True)
    return res


def _spawn(argv: list[str], timeout: float, mem_limit: int | None = None) -> dict | None:
    """Run one worker; ``mem_limit`` (bytes of address space) makes running out of RAM a clean allocation
    failure in that process instead of the kernel's OOM killer picking a victim on the machine."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", *argv]

    def limit() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           preexec_fn=limit if mem_limit else None)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"timeout after {timeout:.0f}s"}
    sys.stderr.write(p.stderr[-3000:])
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"ok": True, **json.loads(line[7:])}
    return {"ok": False, "why": f"exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1][:300]}"}


def in_processes(args) -> dict:
    """overhead/offload with every run of an engine in a process of its own, ``--processes`` rounds alternated
    (plain, offload, then offload, plain, ...): nothing one engine leaves behind (heap, threads, caches) reaches the
    other's steps. The ratio is the median over rounds of each round's pair of median step times."""
    common = ["--preset", args.preset, "--steps", str(args.steps + args.warmup), "--micro-batch",
              str(args.micro_batch), "--seq-len", str(args.seq_len), "--grad-clip", str(args.grad_clip)]
    for kv in args.set:
        common += ["--set", kv]
    argv = {"plain": common + ["--engine", "plain"],
            "offload": common + ["--engine", "offload", "--budget-fraction", "0.25" if args.mode == "offload" else "0",
                                 "--device-budget", "", "--host-budget", "", "--disk-dir", args.disk_dir]}
    runs: dict[str, list[dict]] = {"plain": [], "offload": []}
    order = ["plain", "offload"]
    for r in range(args.processes):
        for name in order:
            res = _spawn(argv[name], args.timeout)
            if not res.get("ok"):
                raise SystemExit(f"{name} worker failed: {res.get('why')}")
            res["median_step_s"] = statistics.median(res["step_s"][args.warmup:])
            print(f"round {r} {name}: {res['median_step_s']:.4f} s/step", flush=True)
            runs[name].append(res)
        order.reverse()
    med = {k: [r["median_step_s"] for r in v] for k, v in runs.items()}
    pairs = [p / o for p, o in zip(med["plain"], med["offload"])]
    off = runs["offload"][-1]
    moved = [m for m in off["moved"][args.warmup:] if m]
    return {
        "mode": args.mode, "preset": args.preset, "protocol": f"{args.processes} rounds, one process per run",
        "tokens_per_step": off["tokens_per_step"], "steps_timed": args.steps, "warmup_steps": args.warmup,
        "median_step_s_per_run": med, "ratio_per_round": pairs,
        "ratio_offload_over_plain": statistics.median(pairs),
        "ratio_of_medians": statistics.median(med["plain"]) / statistics.median(med["offload"]),
        "losses_equal": all(r["losses"] == runs["plain"][0]["losses"] for v in runs.values() for r in v),
        "plan": off["plan"], "measured_peak_bytes": off["measured_peak_bytes"],
        "moved_per_step_median": {k: statistics.median(m[k] for m in moved) for k in moved[0]} if moved else {},
        "load_average": os.getloadavg(),
    }


def beyond_ram(args) -> dict:
    common = ["--preset", "gpt2-774m", "--steps", str(args.steps), "--micro-batch", str(args.micro_batch),
              "--seq-len", str(args.seq_len), "--grad-clip", str(args.grad_clip)]
    off = _spawn(common + ["--engine", "offload", "--probe-bandwidths", "--device-budget", args.device_budget,
                           "--host-budget", args.host_budget, "--disk-dir", args.disk_dir], args.timeout)
    plain = _spawn(common + ["--engine", "plain"], args.timeout)
    out = {"mode": "beyond-ram", "offload": off, "plain": plain}
    if off and off.get("ok") and plain and plain.get("ok"):
        mo, mp = statistics.median(off["step_s"][1:]), statistics.median(plain["step_s"][1:])
        tr = off["plan"]["predicted_traffic"]
        bw = off["bandwidths"]
        out.update(median_step_s={"offload": mo, "plain": mp}, ratio_offload_over_plain=mp / mo,
                   disk_bytes_per_step=tr["disk_read"] + tr["disk_write"],
                   measured_disk_bytes_per_step=statistics.median(
                       m["moved_disk_read_bytes"] + m["moved_disk_write_bytes"] for m in off["moved"][1:]),
                   disk_bound_s=tr["disk_read"] / bw["disk_read"] + tr["disk_write"] / bw["disk_write"],
                   losses_equal=off["losses"] == plain["losses"])
    return out


def capacity(args) -> dict:
    presets = args.presets.split(",")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # every run may use 90% of RAM as address space: a model that does not fit fails to allocate, measured
    mem_limit = int(0.9 * ram)
    out = {"mode": "capacity", "runs": {}, "ram_bytes": ram, "address_space_limit_bytes": mem_limit}
    for engine in args.engines.split(","):
        for preset in presets:
            argv = ["--preset", preset, "--steps", "3", "--micro-batch", "1", "--seq-len", "64", "--engine", engine,
                    "--device-budget", args.device_budget, "--host-budget", args.host_budget, "--disk-dir",
                    args.disk_dir]
            r = _spawn(argv, args.timeout, mem_limit)
            out["runs"][f"{engine}:{preset}"] = r
            print(engine, preset, r.get("ok"), r.get("why", ""), flush=True)
            if not r.get("ok"):
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["overhead", "offload", "beyond-ram", "capacity", "worker"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--engine", default="plain")
    ap.add_argument("--device-budget", default="1GB")
    ap.add_argument("--host-budget", default="1GB")
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--presets", default="gpt2-355m,gpt2-774m,gpt2-1.5b,gpt-2.7b")
    ap.add_argument("--engines", default="plain,offload")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--grad-clip", type=float, default=1.0,
                    help="optim.grad_clip of both engines (0 lets the offload engine update during the backward)")
    ap.add_argument("--out", default="")
    ap.add_argument("--block", type=int, default=0,
                    help="overhead/offload: consecutive steps per engine before switching (0: all, plain first; "
                         "see the module doc)")
    ap.add_argument("--processes", type=int, default=0,
                    help="overhead/offload: rounds of one process per engine run, alternated (0: both in this one)")
    ap.add_argument("--budget-fraction", type=float, default=0.0,
                    help="worker: the offload device budget as a fraction of the training state (0: --device-budget)")
    ap.add_argument("--probe-bandwidths", action="store_true",
                    help="worker: measure the bandwidths (disk included) after the run and report them")
    ap.add_argument("--device", default="cpu", help="overhead/offload: the device both engines train on (cuda: a GPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for both engines (overhead, offload, worker), e.g. train.precision='bf16'")
    args = ap.parse_args()
    if args.mode == "worker":
        _worker(args)
        return
    if args.mode in ("overhead", "offload") and args.processes:
        res = in_processes(args)
    elif args.mode in ("overhead", "offload"):
        res = side_by_side(args.mode, args.preset, args.micro_batch, args.seq_len, args.steps, args.warmup,
                           args.device, args.set, args.block)
    elif args.mode == "beyond-ram":
        res = beyond_ram(args)
    else:
        res = capacity(args)
    res["command"] = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.out) if args.out else RESULTS / f"offload_{args.mode.replace('-', '_')}.json"
    path.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k not in ("plan", "runs", "offload", "plain")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
