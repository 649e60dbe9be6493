"""Benchmark: the offload engine side by side with the plain engine (one run, same model and batches).

Runbook::

    python benchmarks/offload_bench.py overhead      # budget ≥ training state: everything stays on the device
    python benchmarks/offload_bench.py offload       # device budget = 25% of the training state
    python benchmarks/offload_bench.py beyond-ram    # GPT-2 774M, RAM budgets adding up to 2 GB, rest on disk
    python benchmarks/offload_bench.py capacity      # largest preset each engine trains for 3 steps, and its MFU

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

Issue 20's settings (the seeds' — Elixir, ZeRO-Offload — on a GPU; benchmarks/gpu_check.sh runs them, docs/gpu.md
says how): ``--micro-batch 0`` takes the largest power of two the plain engine trains on the device (batch_fit.py;
where no offload plan fits the budget at it, both engines halve it), ``--tokens-per-step`` accumulates micro-batches
to about that many tokens per optimizer step, the same for both engines. Every mode prints and writes tokens/s and
MFU: the model's FLOPs per token (``BlockSeq.flops_per_token``) over the device's peak (stratum.runtime.peak: a
known GPU's datasheet rate for the precision, else a matrix product measured on the device, labelled so). With a
GPU the offload engine's CUDA allocator peak is set against its budget, and ``capacity`` runs on the GPU with the
machine's RAM and disk as the other tiers (``--device-budget auto``: 90 % of the GPU's memory)::

    python benchmarks/offload_bench.py offload --device cuda --preset gpt2-774m --micro-batch 0 \
        --tokens-per-step 262144 --seq-len 1024 --steps 5 --warmup 2 --set train.precision='bf16'
    python benchmarks/offload_bench.py capacity --device cuda --engines offload --presets gpt-6.7b \
        --micro-batch 8 --seq-len 2048 --tokens-per-step 262144 --device-budget auto --host-budget auto \
        --disk-dir /var/tmp/stratum-offload --set train.precision='bf16'
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

from batch_fit import accumulation, out_of_memory, plain_fit, release

from stratum.atomic import atomic_write_json

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# Defaults of the size arguments: capacity's runs are about fitting, not speed (one short sequence, three steps)
MODE_DEFAULTS = {"capacity": {"micro_batch": 1, "seq_len": 64, "steps": 3, "warmup": 1},
                 "other": {"micro_batch": 8, "seq_len": 128, "steps": 8, "warmup": 2}}


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


def _search_batch(args, dev) -> dict:
    """The micro-batch and accumulation of this run: ``--micro-batch`` as given, or (0) the largest the plain
    engine trains on the device (batch_fit); ``--tokens-per-step`` sets the accumulation (0: one micro-batch)."""
    from stratum.model.build import build_model

    micro, tried = args.micro_batch, []
    if micro == 0:
        cfg = _cfg(args.preset, 1, args.seq_len, args.set)
        model = build_model(cfg.model, tokenizer_vocab=256, seq_len=args.seq_len, seed=0)
        micro, tried = plain_fit(cfg, model, dev, args.max_micro_batch)
        del model
        release(dev)
        print(f"largest micro-batch the plain engine trains: {micro} ({tried})", flush=True)
    accum = accumulation(args.tokens_per_step, micro, args.seq_len)
    return {"micro_batch": micro, "grad_accum": accum, "batch_search": tried}


def _timed_steps(eng, name: str, batches, lo: int, hi: int, warmup: int, dev, rec: dict) -> None:
    """Steps ``lo``..``hi`` of one engine; a step is timed after warm-up and unless it opens a later block (the
    other engine's background work has just been drained). Appends to ``rec``'s times, losses and moved."""
    from stratum.runtime.device import synchronize

    for s in range(lo, hi):
        synchronize(dev)
        t = time.perf_counter()
        r = eng.train_step(batches[s], 1e-4)
        synchronize(dev)
        dt = time.perf_counter() - t
        rec["losses"][name].append(r.loss)
        if s >= warmup and (s > lo or lo == 0):
            rec["times"][name].append(dt)
            if name == "offload":
                rec["moved"].append(eng.step_io())
        print(f"step {s} {name}: {dt:.3f}s", flush=True)
    if hasattr(eng, "drain"):
        eng.drain()
    synchronize(dev)


def _cuda_peak(dev, base: int) -> int | None:
    """The CUDA allocator's peak since its last reset, less ``base`` (what was allocated before); None on a CPU."""
    import torch
    return torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None


def _run_pair(make: dict, batches, warmup: int, block: int, dev, rec: dict) -> None:
    """Both engines (``make``: name → a function building it, called when its first step comes) over the same
    batches in blocks of ``block`` steps, plain first. Where plain's steps all come first, its engine is dropped
    before the offload engine is built, so the CUDA peak read over the offload engine's steps is its own (less
    what was allocated before it was built). Fills ``rec`` as it goes (a failure leaves what ran before it)."""
    import torch

    engines: dict = {}
    order, base = ["plain", "offload"], 0
    for lo in range(0, len(batches), block):
        for name in order:
            if name not in engines:
                if name == "offload" and lo + block >= len(batches):
                    engines.pop("plain", None)
                release(dev)
                base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
                engines[name] = make[name]()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            _timed_steps(engines[name], name, batches, lo, min(lo + block, len(batches)), warmup, dev, rec)
            peak = _cuda_peak(dev, base)
            if name == "offload" and peak is not None:
                rec["offload_cuda_peak_bytes"] = max(peak, rec["offload_cuda_peak_bytes"] or 0)
        order.reverse()
    rec["offload"] = engines["offload"]


def _plan(args, model, dev, batch: dict) -> tuple:
    """The configs of both engines and the offload plan at ``batch``. Where the planner finds no placement at this
    micro-batch (one block's activations alone exceed the budget), the micro-batch halves and the accumulation
    doubles — the same tokens per step, for both engines — each such try kept in ``plan_backoff``."""
    from stratum.errors import StratumError
    from stratum.offload.setup import placement_for

    budget = "" if args.mode == "overhead" else str(16 * model.num_params() // 4)
    backoff: list[dict] = []
    while True:
        extra = [*args.set, f"train.grad_accum={batch['grad_accum']}"]
        cfg = _cfg(args.preset, batch["micro_batch"], args.seq_len, extra)
        ocfg = _cfg(args.preset, batch["micro_batch"], args.seq_len, [*extra, f"offload.device_budget={budget!r}"])
        t0 = time.perf_counter()
        try:
            plan = placement_for(ocfg, model, dev, always_profile=True)
        except StratumError as err:
            if batch["micro_batch"] == 1 or "no placement fits" not in str(err):
                raise
            print(f"micro-batch {batch['micro_batch']}: {err}; halving it", flush=True)
            backoff.append({"micro_batch": batch["micro_batch"], "why": str(err)})
            batch = {**batch, "micro_batch": batch["micro_batch"] // 2, "grad_accum": 2 * batch["grad_accum"]}
            continue
        return cfg, ocfg, plan, time.perf_counter() - t0, {**batch, "plan_backoff": backoff}


def side_by_side(args) -> dict:
    """overhead / offload in one process: both engines on the same model and batches (the module doc). An engine
    running out of device memory, or the offload engine's allocator check failing, gives a result with ``error``
    and the steps timed before it."""
    from stratum.model.build import build_model
    from stratum.parallel.compose import make_engine
    from stratum.runtime.device import resolve_device

    dev = resolve_device(args.device)
    batch = _search_batch(args, dev)
    cfg = _cfg(args.preset, batch["micro_batch"], args.seq_len, args.set)
    model = build_model(cfg.model, tokenizer_vocab=_batches(cfg, 0)[1], seq_len=args.seq_len, seed=0)
    cfg, ocfg, plan, plan_s, batch = _plan(args, model, dev, batch)
    batches = _batches(cfg, args.steps + args.warmup)[0]
    block = args.block if args.block > 0 else len(batches)
    # the offload engine trains ``model``'s own tensors, so a second plain run starts from a copy taken now
    pristine = copy.deepcopy(model) if args.plain_twice else None
    make = _makers(cfg, ocfg, model, plan, dev)
    rec: dict = {"times": {"plain": [], "offload": []}, "losses": {"plain": [], "offload": []}, "moved": [],
                 "offload_cuda_peak_bytes": None}
    head = {"mode": args.mode, "preset": args.preset, "params": model.num_params(),
            "train_state_bytes": 16 * model.num_params(), "device_budget_bytes": plan.device_budget, **batch,
            "seq_len": args.seq_len, "tokens_per_step": cfg.tokens_per_step, "warmup_steps": args.warmup,
            "block_steps": block, "plan": plan.to_dict(), "plan_s": plan_s}
    try:
        _run_pair(make, batches, args.warmup, block, dev, rec)
    except (AssertionError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not out_of_memory(err):
            raise
        return {**head, "error": f"{type(err).__name__}: {str(err)[:500]}", "step_s": rec["times"],
                "losses": rec["losses"], "load_average": os.getloadavg()}
    off = rec.pop("offload")
    out = {**head, **_pair_result(rec, cfg, dev, model.flops_per_token(args.seq_len)),
           "measured_peak_bytes": off.measured_peaks(),
           "cuda_peak_under_budget": _under(rec["offload_cuda_peak_bytes"], plan.device_budget),
           "fetches": off.n_fetches, "bytes_h2d": off.bytes_h2d, "bytes_d2h": off.bytes_d2h}
    off.close()
    # what the offload engine left on the device (a resident chunk is the model's parameters' storage) goes with it
    del off, make, model
    if pristine is not None:
        out["plain_again_max_rel_loss_diff"] = _plain_again(lambda: make_engine(cfg, pristine, dev), batches,
                                                            rec["losses"]["plain"], dev)
    return out


def _plain_again(make_plain, batches, losses: list[float], dev) -> float | None:
    """The plain engine run again over the same batches from the same weights: the largest relative difference
    from its first run's losses — the device's own run-to-run spread, against which the offload engine's is read
    (attention's backward kernels on a GPU accumulate with atomics). None where it ran out of device memory."""
    release(dev)
    engine = make_plain()
    try:
        again = [engine.train_step(b, 1e-4).loss for b in batches]
    except RuntimeError as err:
        if not out_of_memory(err):
            raise
        print(f"plain again: out of memory ({str(err)[:200]})", flush=True)
        return None
    diff = max(abs(a - b) / abs(a) for a, b in zip(losses, again))
    print(f"plain again: max rel loss diff {diff:.1e}", flush=True)
    return diff


def _makers(cfg, ocfg, model, plan, dev) -> dict:
    """Name → a function building that engine. The offload engine checks the GPU allocator's bytes against its
    budget (all of this process's bytes since it was built), so each is built only when its first step comes, after
    the plain engine's allocations."""
    from stratum.offload.setup import offload_engine
    from stratum.parallel.compose import make_engine

    return {"plain": lambda: make_engine(cfg, copy.deepcopy(model), dev),
            "offload": lambda: offload_engine(ocfg, model, dev, plan)}


def _pair_result(rec: dict, cfg, dev, flops_per_token: float) -> dict:
    """Timings, throughput, MFU and loss agreement of a side-by-side run, for the JSON."""
    import torch

    from stratum.runtime.device import describe

    tokens = cfg.tokens_per_step
    med = {k: statistics.median(v) for k, v in rec["times"].items()}
    tps = {k: tokens / v for k, v in med.items()}
    losses = rec["losses"]
    return {"steps_timed": len(rec["times"]["offload"]), "threads": torch.get_num_threads(), "device": describe(dev),
            "median_step_s": med, "tokens_per_s": tps, "ratio_offload_over_plain": med["plain"] / med["offload"],
            **_mfu_fields(flops_per_token, tps, dev, cfg.train.precision),
            "losses": losses, "losses_equal": losses["plain"] == losses["offload"],
            "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in zip(losses["plain"], losses["offload"])),
            "offload_cuda_peak_bytes": rec["offload_cuda_peak_bytes"], "moved_per_step_median": _median_moved(
                rec["moved"]), "load_average": os.getloadavg()}


def _under(peak: int | None, budget: int | None) -> bool | None:
    """Whether the CUDA allocator's peak stayed within the device budget (None: no GPU or no budget)."""
    return None if peak is None or budget is None else peak <= budget


def _median_moved(moved: list[dict]) -> dict:
    moved = [m for m in moved if m]
    return {k: statistics.median(m[k] for m in moved) for k in moved[0]} if moved else {}


def _mfu_fields(flops_per_token: float, tokens_per_s: dict, dev, precision: str) -> dict:
    """Model FLOPs per token, the device's peak (published or measured) and each engine's MFU, for the JSON."""
    from stratum.runtime.peak import device_peak, mfu

    peak = device_peak(dev, precision)
    rates = {k: mfu(flops_per_token, v, peak) for k, v in tokens_per_s.items()}
    print("MFU " + ", ".join(f"{k} {v:.1%}" for k, v in rates.items()) + f" (peak {peak.flops / 1e12:.1f} TFLOP/s, "
          f"{peak.source})", flush=True)
    return {"flops_per_token": flops_per_token, "peak": peak.to_dict(), "mfu": rates}


def _auto_budget(spec: str, total: int) -> str:
    """``auto``: 90 % of ``total`` bytes (a GPU's memory, the machine's RAM), leaving room for the CUDA context, the
    allocator's fragmentation and the process itself; anything else as given."""
    return str(int(0.9 * total)) if spec == "auto" else spec


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _worker_engine(args, dev):
    """The worker's config and engine (the offload engine's model built block by block, as the trainer does)."""
    import torch

    from stratum.model.build import build_model
    from stratum.parallel.compose import make_engine

    accum = accumulation(args.tokens_per_step, args.micro_batch, args.seq_len)
    common = ["train.seed=0", f"optim.grad_clip={args.grad_clip}", f"train.grad_accum={accum}", *args.set]
    cfg = _cfg(args.preset, args.micro_batch, args.seq_len, common)
    batches, vocab = _batches(cfg, args.steps)
    model = build_model(cfg.model, tokenizer_vocab=vocab, seq_len=args.seq_len, seed=0,
                        lazy=args.engine == "offload")
    extra = [f"train.engine={args.engine!r}"]
    if args.engine == "offload":
        budget = _auto_budget(args.device_budget, torch.cuda.get_device_properties(dev).total_memory
                              if dev.type == "cuda" else _ram_bytes())
        if args.budget_fraction:  # of the training state: parameters, gradients and AdamW's two moments in fp32
            budget = str(int(args.budget_fraction * 16 * model.num_params()))
        extra += [f"offload.device_budget={budget!r}",
                  f"offload.host_budget={_auto_budget(args.host_budget, _ram_bytes())!r}",
                  f"offload.disk_dir={args.disk_dir!r}"]
    cfg = _cfg(args.preset, args.micro_batch, args.seq_len, extra + common)
    flops = model.flops_per_token(args.seq_len)
    return cfg, make_engine(cfg, model, dev), batches, flops


def _worker(args) -> dict:
    """One engine, one process: ``steps`` steps of ``preset``; prints a JSON line."""
    import torch

    from stratum.runtime.device import peak_rss_bytes, resolve_device, synchronize

    dev = resolve_device(args.device)
    t0 = time.perf_counter()
    cfg, engine, batches, flops = _worker_engine(args, dev)
    setup_s = time.perf_counter() - t0
    times, losses, stalls, phases, moved = [], [], [], [], []
    for b in batches:
        synchronize(dev)
        t = time.perf_counter()
        s0 = getattr(engine, "stall_s", 0.0)
        p0 = dict(getattr(engine, "phase_s", {}))
        losses.append(engine.train_step(b, 1e-4).loss)
        synchronize(dev)
        times.append(time.perf_counter() - t)
        stalls.append(getattr(engine, "stall_s", 0.0) - s0)
        phases.append({k: v - p0[k] for k, v in getattr(engine, "phase_s", {}).items()})
        moved.append(engine.step_io())
        print(f"step {len(times)}: {times[-1]:.1f}s (waiting for chunks {stalls[-1]:.1f}s; phases "
              f"{ {k: round(v, 1) for k, v in phases[-1].items()} }) loss {losses[-1]:.4f} "
              f"rss peak {peak_rss_bytes() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    tokens = cfg.tokens_per_step
    med = statistics.median(times[args.warmup:] or times)
    res = {"engine": args.engine, "preset": args.preset, "device": str(dev), "step_s": times, "stall_s": stalls,
           "phase_s": phases, "moved": moved, "losses": losses, "setup_s": setup_s,
           "micro_batch": args.micro_batch, "grad_accum": cfg.train.grad_accum, "seq_len": args.seq_len,
           "peak_rss_bytes": peak_rss_bytes(), "tokens_per_step": tokens, "median_step_s": med,
           "cuda_peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
           **_mfu_fields(flops, {args.engine: tokens / med}, dev, cfg.train.precision)}
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
    if args.micro_batch == 0:
        raise SystemExit("--processes needs a --micro-batch (0 searches for it in one process only)")
    common = ["--preset", args.preset, "--steps", str(args.steps + args.warmup), "--warmup", str(args.warmup),
              "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--grad-clip",
              str(args.grad_clip), "--device", args.device, "--tokens-per-step", str(args.tokens_per_step)]
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
    """The largest preset each engine trains (``--steps`` steps at ``--micro-batch`` × ``--seq-len``, accumulated to
    ``--tokens-per-step``), presets in the order given, each run in a process of its own; an engine's first preset
    that fails ends its list. On a CPU every run may use 90 % of RAM as address space, so running out of memory is
    a clean allocation failure (a GPU process maps far more address space than it uses, so not there). The offload
    engine's tiers are the device (``--device-budget``, ``auto``: 90 % of it), the host's RAM (``--host-budget``)
    and ``--disk-dir``; ``best`` gives each engine's largest preset, and the offload engine's largest at ``--mfu-goal``
    or more."""
    ram = _ram_bytes()
    mem_limit = int(0.9 * ram) if args.device == "cpu" else None
    out: dict = {"mode": "capacity", "runs": {}, "ram_bytes": ram, "address_space_limit_bytes": mem_limit,
                 "disk_free_bytes": _disk_free(args.disk_dir), "mfu_goal": args.mfu_goal}
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch),
              "--seq-len", str(args.seq_len), "--tokens-per-step", str(args.tokens_per_step), "--device",
              args.device, "--device-budget", args.device_budget, "--host-budget", args.host_budget, "--disk-dir",
              args.disk_dir, "--grad-clip", str(args.grad_clip)]
    for kv in args.set:
        common += ["--set", kv]
    for engine in args.engines.split(","):
        for preset in args.presets.split(","):
            r = _spawn(["--preset", preset, "--engine", engine, *common], args.timeout, mem_limit)
            out["runs"][f"{engine}:{preset}"] = r
            print(engine, preset, r.get("ok"), r.get("why", ""), _mfu_text(r), flush=True)
            if not r.get("ok"):
                break
    out["best"] = _capacity_best(out["runs"], args.mfu_goal)
    return out


def _mfu_text(run: dict) -> str:
    return f"MFU {run['mfu'][run['engine']]:.1%}" if run.get("ok") else ""


def _capacity_best(runs: dict, goal: float) -> dict:
    """Per engine: the last preset (in the order run) that trained, and the last that trained at ``goal`` MFU."""
    best: dict = {}
    for key, r in runs.items():
        engine, preset = key.split(":", 1)
        b = best.setdefault(engine, {"trains": None, "at_mfu_goal": None})
        if r.get("ok"):
            b["trains"] = preset
            if r["mfu"][engine] >= goal:
                b["at_mfu_goal"] = preset
    return best


def _disk_free(disk_dir: str) -> int:
    import shutil
    return shutil.disk_usage(disk_dir or "/tmp").free


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["overhead", "offload", "beyond-ram", "capacity", "worker"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per micro-batch (default 8; capacity 1); 0 (overhead, offload): the largest "
                         "power of two the plain engine trains on the device, at most --max-micro-batch")
    ap.add_argument("--max-micro-batch", type=int, default=64, help="--micro-batch 0: the largest size tried")
    ap.add_argument("--tokens-per-step", type=int, default=0,
                    help="gradient accumulation to about this many tokens per optimizer step (0: one micro-batch)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128; capacity 64)")
    ap.add_argument("--steps", type=int, default=None, help="steps after warm-up (default 8; capacity: in all, 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; capacity 1)")
    ap.add_argument("--mfu-goal", type=float, default=0.3, help="capacity: the MFU a preset must reach to count")
    ap.add_argument("--plain-twice", action="store_true",
                    help="overhead/offload in one process: run the plain engine again afterwards, untimed, and "
                         "report how far its losses are from its first run's (the device's own spread)")
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
    ap.add_argument("--device", default="cpu", help="the device the engines train on (cuda: a GPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for both engines (overhead, offload, worker), e.g. train.precision='bf16'")
    return ap


def main() -> None:
    args = _parser().parse_args()
    for key, value in (MODE_DEFAULTS["capacity"] if args.mode == "capacity" else MODE_DEFAULTS["other"]).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.mode == "worker":
        _worker(args)
        return
    if args.mode in ("overhead", "offload") and args.processes:
        res = in_processes(args)
    elif args.mode in ("overhead", "offload"):
        res = side_by_side(args)
    elif args.mode == "beyond-ram":
        res = beyond_ram(args)
    else:
        res = capacity(args)
    res["command"] = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.out) if args.out else RESULTS / f"offload_{args.mode.replace('-', '_')}.json"
    atomic_write_json(path, res)
    print(json.dumps({k: v for k, v in res.items() if k not in ("plan", "runs", "offload", "plain", "losses")},
                     indent=2))
    print(f"wrote {path}")
    print(_headline(res))
    if "error" in res:
        raise SystemExit(1)


def _headline(res: dict) -> str:
    """One line of what a run found, printed last (the GPU check's summary keeps its logs' last lines)."""
    if "error" in res:
        return (f"{res['mode']} {res['preset']}: FAILED at micro-batch {res['micro_batch']} x {res['grad_accum']}: "
                f"{res['error'][:300]}")
    if res["mode"] == "capacity":
        return f"capacity: {res['best']} (MFU goal {res['mfu_goal']:.0%}; runs: " + ", ".join(
            f"{k} {_mfu_text(r) or r.get('why', '')[:120]}" for k, r in res["runs"].items()) + ")"
    if "mfu" not in res:  # beyond-ram, or in processes
        return f"{res['mode']}: offload/plain {res.get('ratio_offload_over_plain', float('nan')):.3f}x"
    tps, mfu = res["tokens_per_s"], res["mfu"]
    peak, budget = res["offload_cuda_peak_bytes"], res["device_budget_bytes"]
    return (f"{res['mode']} {res['preset']}: micro-batch {res['micro_batch']} x {res['grad_accum']} x "
            f"{res['seq_len']} = {res['tokens_per_step']:,} tokens/step; plain {tps['plain']:,.0f} tok/s MFU "
            f"{mfu['plain']:.1%}, offload {tps['offload']:,.0f} tok/s MFU {mfu['offload']:.1%}: "
            f"{res['ratio_offload_over_plain']:.3f}x plain; losses max rel diff {res['max_rel_loss_diff']:.1e} "
            f"(plain against itself {_num(res.get('plain_again_max_rel_loss_diff'))}); "
            f"CUDA peak {_size(peak)} against budget {_size(budget)}; peak {res['peak']['source']}")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _size(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


if __name__ == "__main__":
    from stratum.errors import StratumError
    try:
        main()
    except StratumError as err:  # bad input or a budget no plan fits: one line, no traceback
        raise SystemExit(f"offload_bench: {err}") from None
