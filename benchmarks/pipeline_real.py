"""Benchmark: real multi-process pipeline steps against the plain engine and the simulator's prediction.

Runbook::

    python benchmarks/pipeline_real.py                         # GPT 'small', P = 2 and 4, every schedule
    python benchmarks/pipeline_real.py --ranks 2 --steps 4 --preset mini
    python benchmarks/pipeline_real.py --ranks 2 --kinds zb-1f1b zb-wave --rewalk   # the former W, for comparison
    python benchmarks/pipeline_real.py --split-backward     # B vs I + W on one stage, in this process (no ranks)

What it does, all on the same model, batches and AdamW:

- **plain**: the plain engine in this process, 1 thread and all cores' threads (tokens/s);
- **profile**: ``profile_from_config`` (what ``stratum profile`` runs) with the intra-op thread count a pipeline
  rank uses, ``max(1, cores // P)`` (what ``stratum.dist.launch`` sets as OMP_NUM_THREADS; one profile per distinct
  thread count); a ping-pong between two gloo processes measures the time of one stage-boundary message;
- **simulated** (the prediction of the step time), three terms, each measured or derived, none fitted:

  1. the makespan of the schedule's forward/backward actions with per-stage costs from the profile
     (:func:`stratum.plan.evaluate` of the even partition the workers run + :func:`stratum.plan.stage_costs`) and
     the measured one-way message time as latency;
  2. **core sharing**: when the P ranks' threads exceed the cores (P x threads > cores), the ranks that are
     computing at the same moment share the cores. :func:`simulate_shared` is the simulator's event model with
     processor sharing: while n ranks compute, each progresses at ``min(1, cores / (n x threads))`` of its
     profiled speed; a rank waiting for a message uses no core (gloo's receive blocks, it does not spin). With
     enough cores it equals :func:`stratum.sim.pipeline.simulate` exactly (checked at run time). For comparison the
     JSON also holds the two bounds: one device per rank (plain ``simulate``, speed 1) and every rank always at
     ``cores / (P x threads)`` (``speeds`` of the partition: right only if no rank ever idles);
  3. **fixed per-step costs** the simulator leaves out, measured in the same run: ``post`` = from the moment the
     last rank finishes its schedule to the moment the last rank returns from ``train_step`` (tied-gradient and
     gradient-norm/loss all-reduces, clipping, AdamW step, zero_grad), and ``pre`` = from the step's start to the
     last rank entering its schedule; medians over the timed steps. The AdamW step alone is also timed per rank
     (``opt_s_per_rank``, all ranks at once, so with core sharing) to show what ``post`` is made of.
- **measured**: P local gloo processes (``max(1, cores // P)`` threads each) run each schedule for real: median
  step time over ``--steps`` timed steps after a warm-up, tokens/s.

``--rewalk`` makes the workers' W walk the retained graph from the stage output again (the runtime before the
zero-bubble split: I's work done twice), so the split's effect can be measured under the same conditions.
``--split-backward`` instead times, in this process with 1 thread, one middle and the last stage of the P = 2
zb-wave partition: F, B, and I / W with the split and with the re-walk (medians of ``--steps`` interleaved
repetitions), plus the FLOPs of each (``FlopCounterMode``); it writes ``benchmarks/results/split_backward.json``.

Writes ``benchmarks/results/pipeline_real.json``. Labels in the output say which figures are measured and which
are simulated. On a machine with fewer cores than P the ranks share cores: term 2 above models that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "pipeline_real.json"
SPLIT_OUT = HERE / "results" / "split_backward.json"
KINDS = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"virtual": 2}), ("wave", {"waves": 1}),
         ("zb-1f1b", {}), ("zb-wave", {"waves": 1})]


def make_cfg(a):
    from stratum.config import load_config
    return load_config(None, [f"model.preset={a['preset']!r}", f"data.seq_len={a['seq_len']}",
                              f"train.micro_batch_size={a['micro_batch']}", f"train.grad_accum={a['m']}",
                              f"data.cache_dir={a['cache_dir']!r}", "train.device='cpu'"])


def batches_for(cfg, steps):
    from stratum.data.prepare import prepare_data
    from stratum.data.tokens import TRAIN
    data = prepare_data(cfg)
    return [data.sampler.micro_batches(TRAIN, s, cfg.train.micro_batch_size, cfg.train.grad_accum)
            for s in range(steps)]


def kinds_of(job: dict) -> list[tuple[str, dict]]:
    return [(k, kw) for k, kw in KINDS if not job.get("kinds") or k in job["kinds"]]


def _input_grad_only(out, grad_out, inp, params):
    """The former I: the input gradient from the retained graph and no intermediates, so W walks from the output
    again (the runtime before the zero-bubble split)."""
    import torch
    (g,) = torch.autograd.grad(out, [inp], grad_out, retain_graph=True, allow_unused=True)
    return g, None


def use_rewalk() -> None:
    """The former W in this process (``--rewalk``)."""
    from stratum.runtime import stage
    stage._backward_input = _input_grad_only


def split_backward_side(a) -> dict:
    """F, B, I, W times (s, median of interleaved repetitions, 1 thread) and FLOPs of a middle and the last stage
    of the P = 2 zb-wave partition, with the zero-bubble split and with the former re-walking W."""
    import tempfile

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from stratum.model.build import build_model
    from stratum.plan.partition import even_partition
    from stratum.runtime import stage
    from stratum.runtime.stage import StageRuntime
    from stratum.schedule.ir import Action

    torch.set_num_threads(1)
    split_input = stage._backward_input
    job = {"preset": a.preset, "seq_len": a.seq_len, "micro_batch": a.micro_batch, "m": 1,
           "cache_dir": str(Path(tempfile.mkdtemp(prefix="splitbench-")) / "cache")}
    cfg = make_cfg(job)
    batch = batches_for(cfg, 1)[0][0]
    model = build_model(cfg.model, tokenizer_vocab=256, seq_len=cfg.data.seq_len, seed=0)
    blocks = list(model.blocks)
    stages = even_partition(len(blocks), 4)  # zb-wave, P = 2, W = 1: 4 stages
    rt = StageRuntime(blocks=blocks, stages=stages, stage_to_rank=(0,) * 4, loss_fn=model.loss_fn, rank=0,
                      device=torch.device("cpu"), precision="fp32", timeout_s=60, backend="gloo")
    out: dict = {"preset": a.preset, "seq_len": a.seq_len, "micro_batch": a.micro_batch, "threads": 1,
                 "repeats": a.steps, "stages": [[r.start, r.stop] for r in stages], "torch": torch.__version__,
                 "cpu_count": os.cpu_count(), "load_average_before": os.getloadavg()[0], "stage": {}}
    for s, label in ((1, "middle"), (3, "last")):
        with torch.no_grad():
            x = batch.x
            for i in range(stages[s].start):
                x = blocks[i](x)
        gen = torch.Generator().manual_seed(0)
        last = s == 3
        g_out = None if last else torch.randn(x.shape, generator=gen)

        def act(kind, saved):  # called within this iteration only, so it sees this stage's x, last, g_out, s
            inputs = {"F": [x], "B": [] if last else [g_out], "I": [] if last else [g_out], "W": []}[kind]  # noqa: B023
            t0 = time.perf_counter()
            rt._execute(Action(kind, s, 0), inputs, [batch], saved, training=True, scale=1.0,  # noqa: B023
                        loss_sum=torch.zeros((), dtype=torch.float64))
            return time.perf_counter() - t0

        def full():
            saved = {}
            return {"F": act("F", saved), "B": act("B", saved)}

        def split(rewalk: bool):
            stage._backward_input = _input_grad_only if rewalk else split_input
            try:
                saved = {}
                return {"F": act("F", saved), "I": act("I", saved), "W": act("W", saved)}
            finally:
                stage._backward_input = split_input

        runs = {"full": [], "split": [], "rewalk": []}
        for _ in range(2):  # warm-up
            full(), split(False), split(True)
        for _ in range(a.steps):
            runs["full"].append(full())
            runs["split"].append(split(False))
            runs["rewalk"].append(split(True))
        med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
        flops = {}
        for mode in ("full", "split", "rewalk"):
            stage._backward_input = _input_grad_only if mode == "rewalk" else split_input
            saved: dict = {}
            act("F", saved)
            flops[mode] = {}
            for kind in (("B",) if mode == "full" else ("I", "W")):
                with FlopCounterMode(display=False) as fc:
                    act(kind, saved)
                flops[mode][kind] = fc.get_total_flops()
        stage._backward_input = split_input
        out["stage"][label] = {"index": s, "blocks": [stages[s].start, stages[s].stop], "median_s": med,
                               "flops": flops, "all_s": runs}
    out["load_average_after"] = os.getloadavg()[0]
    for p in blocks:
        p.grad = None
    return out


def worker(job_path: str) -> None:
    import torch
    import torch.distributed as dist

    from stratum.dist.world import join_world
    from stratum.ir.plan import parse_plan
    from stratum.model.build import build_model
    from stratum.plan.partition import even_partition
    from stratum.runtime import optim_spec
    from stratum.runtime.pipeline import PipelineEngine, PipelinePlan
    from stratum.schedule.generators import generate

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if job.get("rewalk"):
        use_rewalk()
    cfg = make_cfg(job)
    world = int(os.environ["WORLD_SIZE"])
    mesh = join_world(parse_plan(f"pipeline({world})"), torch.device("cpu"), backend="gloo", timeout_s=120)
    rank = dist.get_rank()
    steps = job["warmup"] + job["steps"]
    all_batches = batches_for(cfg, steps)
    out = {"ranks": world, "schedules": {}}
    # one stage-boundary message, timed by ping-pong between ranks 0 and 1
    x = torch.zeros(cfg.train.micro_batch_size, cfg.data.seq_len, job["d_model"])
    dist.barrier()
    if rank in (0, 1):
        n = 30
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
        out["message_s"] = (time.perf_counter() - t0) / (2 * n)
    dist.barrier()
    for kind, kw in kinds_of(job):
        sched = generate(kind, ranks=world, microbatches=cfg.train.grad_accum, **kw)
        model = build_model(cfg.model, tokenizer_vocab=256, seq_len=cfg.data.seq_len, seed=0)
        plan = PipelinePlan(schedule=sched, stages=even_partition(len(model), sched.num_stages))
        eng = PipelineEngine(model, plan=plan, optim=optim_spec(cfg), world=mesh)
        marks: dict = {}
        run_schedule = eng.runtime.run

        def timed_run(*args, _run=run_schedule, _marks=marks, **kw):
            _marks["run_start"] = time.time()
            try:
                return _run(*args, **kw)
            finally:
                _marks["run_end"] = time.time()

        eng.runtime.run = timed_run
        times, losses, stamps = [], [], []
        for s in range(steps):
            dist.barrier()
            t0, w0 = time.perf_counter(), time.time()
            losses.append(eng.train_step(all_batches[s], 1e-4).loss)
            w1 = time.time()
            dist.barrier()
            if s >= job["warmup"]:
                times.append(time.perf_counter() - t0)
                # wall-clock stamps (one clock for all local processes): step start, schedule start/end, step end
                stamps.append((w0, marks["run_start"], marks["run_end"], w1))
        # AdamW share of one step on this rank (the simulator leaves it out)
        for p in (p for _, p in eng.named):
            p.grad = torch.zeros_like(p)
        t0 = time.perf_counter()
        eng.opt.step()
        opt_s = time.perf_counter() - t0
        eng.opt.zero_grad(set_to_none=True)
        got = [None] * world if rank == 0 else None
        dist.gather_object({"opt_s": opt_s, "stats": dict(eng.runtime.stats), "stamps": stamps}, got, dst=0)
        if rank == 0:
            n_t = len(stamps)
            # per timed step: pre = last rank entering its schedule - that rank's step start (max over ranks);
            # post = last train_step return - last schedule end; schedule = last schedule end - first start
            pre = [max(g["stamps"][k][1] - g["stamps"][k][0] for g in got) for k in range(n_t)]
            post = [max(g["stamps"][k][3] for g in got) - max(g["stamps"][k][2] for g in got) for k in range(n_t)]
            span = [max(g["stamps"][k][2] for g in got) - min(g["stamps"][k][1] for g in got) for k in range(n_t)]
            out["schedules"][sched.name] = {
                "kind": kind, "stages": sched.num_stages, "step_s": statistics.median(times), "times": times,
                "losses": losses, "opt_s_max": max(g["opt_s"] for g in got),
                "opt_s_per_rank": [g["opt_s"] for g in got],
                "pre_s": statistics.median(pre), "post_s": statistics.median(post),
                "schedule_span_s": statistics.median(span),
                "wait_s_per_rank": [g["stats"]["wait_s"] for g in got],
                "compute_s_per_rank": [g["stats"]["compute_s"] for g in got],
            }
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def rank_threads(world: int) -> int:
    """Intra-op threads of each of ``world`` local ranks: what ``stratum.dist.launch.spawn_local`` sets."""
    return max(1, (os.cpu_count() or 1) // world)


def spawn(job: dict, world: int, tmp: Path) -> dict:
    from stratum.dist.launch import free_port
    job = dict(job, out=str(tmp / f"out_{world}.json"))
    path = tmp / f"job_{world}.json"
    path.write_text(json.dumps(job))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(path)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       OMP_NUM_THREADS=str(rank_threads(world))))
             for r in range(world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"pipeline workers failed: exit codes {codes}")
    return json.loads(Path(job["out"]).read_text())


def plain_side(job: dict, threads: int) -> dict:
    import torch

    from stratum.model.build import build_model
    from stratum.parallel.compose import make_engine

    torch.set_num_threads(threads)
    cfg = make_cfg(job)
    steps = job["warmup"] + job["steps"]
    bs = batches_for(cfg, steps)
    model = build_model(cfg.model, tokenizer_vocab=256, seq_len=cfg.data.seq_len, seed=0)
    eng = make_engine(cfg, model, torch.device("cpu"))
    times, losses = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        losses.append(eng.train_step(bs[s], 1e-4).loss)
        if s >= job["warmup"]:
            times.append(time.perf_counter() - t0)
    return {"threads": threads, "step_s": statistics.median(times), "losses": losses}


def simulate_shared(schedule, costs, slots: float) -> float:
    """Makespan of ``schedule`` under ``costs`` when the ranks share ``slots`` cores' worth of compute
    (``slots`` = cores / threads per rank): the event model of :func:`stratum.sim.pipeline.simulate` (each rank
    runs its actions in order, an action starts when the rank is free and its inputs have arrived, messages
    cost ``latency + bytes / bandwidth`` and use no core), with processor sharing: while n ranks are inside an
    action each progresses at ``min(1, slots / n)`` seconds of profiled work per second. With slots >= P it is
    ``simulate``'s makespan."""
    P = schedule.num_ranks
    where = schedule.stage_to_rank
    end: dict = {}
    ptr = [0] * P
    free = [0.0] * P
    running: list = [None] * P   # [action, remaining work (s)]
    total = sum(len(a) for a in schedule.actions)
    done, t = 0, 0.0
    eps = 1e-12

    def arrival(a, d):
        if where[d.stage] == where[a.stage]:
            return end[d]
        nbytes = costs.out_bytes[d.stage] if d.kind == "F" else costs.out_bytes[a.stage]
        return end[d] + costs.message_s(nbytes)

    while done < total:
        next_ready = math.inf
        for r, acts in enumerate(schedule.actions):
            if running[r] is not None or ptr[r] >= len(acts):
                continue
            a = acts[ptr[r]]
            ds = schedule.deps(a)
            if any(d not in end for d in ds):
                continue
            ready = max([free[r]] + [arrival(a, d) for d in ds])
            if ready <= t + eps:
                running[r] = [a, costs.compute(a)]
            else:
                next_ready = min(next_ready, ready)
        n = sum(x is not None for x in running)
        rate = min(1.0, slots / n) if n else 0.0
        next_done = min((x[1] / rate for x in running if x is not None), default=math.inf)
        dt = min(next_ready - t, next_done)
        if math.isinf(dt):
            raise RuntimeError(f"schedule {schedule.name} cannot run to the end")
        t += dt
        for r, x in enumerate(running):
            if x is None:
                continue
            x[1] -= rate * dt
            if x[1] <= eps:
                end[x[0]] = t
                free[r] = t
                running[r] = None
                ptr[r] += 1
                done += 1
    return t


def simulate_side(job: dict, profile, world: int, threads: int, message_s: float) -> dict:
    """Per schedule: the makespan with core sharing (the prediction's term 2), and the two bounds."""
    from stratum.plan.partition import evaluate, even_partition, stage_costs
    from stratum.schedule.generators import generate
    from stratum.sim.pipeline import simulate

    cores = os.cpu_count() or 1
    slots = cores / threads
    out = {}
    for kind, kw in kinds_of(job):
        sched = generate(kind, ranks=world, microbatches=job["m"], **kw)
        stages = even_partition(len(profile.blocks), sched.num_stages)
        own = stage_costs(profile, evaluate(profile, stages, sched.stage_to_rank), latency=message_s)
        flat = min(1.0, slots / world)
        slow = stage_costs(profile, evaluate(profile, stages, sched.stage_to_rank, speeds=[flat] * world),
                           latency=message_s)
        own_s = simulate(sched, own).makespan
        shared_s = simulate_shared(sched, own, slots)
        if slots >= world and abs(shared_s - own_s) > 1e-9 * max(1.0, own_s):
            raise SystemExit(f"simulate_shared disagrees with simulate for {sched.name}: {shared_s} vs {own_s}")
        out[sched.name] = {"shared_makespan_s": shared_s, "own_device_makespan_s": own_s,
                           "uniform_speed": flat, "uniform_speed_makespan_s": simulate(sched, slow).makespan}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step (train.grad_accum)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help=f"default {DEFAULT_OUT} ({SPLIT_OUT} with --split-backward)")
    ap.add_argument("--kinds", nargs="+", choices=[k for k, _ in KINDS], help="only these schedule kinds")
    ap.add_argument("--rewalk", action="store_true", help="the former W that re-walks the graph from the output")
    ap.add_argument("--split-backward", action="store_true", help="B vs I + W on one stage, in this process")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
        return
    if a.split_backward:
        res = split_backward_side(a)
        path = Path(a.out or SPLIT_OUT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2))
        print(f"model {a.preset}, seq {a.seq_len}, micro-batch {a.micro_batch}, 1 thread, "
              f"median of {a.steps}; stages {res['stages']}")
        for label, r in res["stage"].items():
            m, f = r["median_s"], r["flops"]
            print(f"  {label} stage {r['index']} (blocks {r['blocks'][0]}..{r['blocks'][1] - 1}):  "
                  f"F {m['full']['F'] * 1e3:.1f} ms  B {m['full']['B'] * 1e3:.1f} ms")
            for mode in ("split", "rewalk"):
                print(f"    {mode:7s} I {m[mode]['I'] * 1e3:7.1f} ms  W {m[mode]['W'] * 1e3:7.1f} ms  "
                      f"I+W {(m[mode]['I'] + m[mode]['W']) * 1e3:7.1f} ms   "
                      f"GFLOP I {f[mode]['I'] / 1e9:.3f} W {f[mode]['W'] / 1e9:.3f} (B {f['full']['B'] / 1e9:.3f})")
        print(f"wrote {path}")
        return
    a.out = a.out or str(DEFAULT_OUT)

    import tempfile

    import torch

    from stratum.model.presets import PRESETS
    from stratum.profile.profiler import profile_from_config

    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="pipebench-"))
    job = {"preset": a.preset, "seq_len": a.seq_len, "micro_batch": a.micro_batch, "m": a.m,
           "cache_dir": str(tmp / "cache"), "warmup": a.warmup, "steps": a.steps,
           "d_model": PRESETS[a.preset].d_model, "kinds": a.kinds, "rewalk": a.rewalk}
    cfg = make_cfg(job)
    batches_for(cfg, 1)  # token cache once, before the workers start
    tokens_per_step = a.micro_batch * a.m * a.seq_len

    profiles = {}
    for th in sorted({rank_threads(w) for w in a.ranks}):
        torch.set_num_threads(th)   # the intra-op threads each rank of that P uses
        profiles[th] = profile_from_config(cfg, runs=5)
        profiles[th].save(str(tmp / f"profile_t{th}.json"))
    plain = [plain_side(job, 1), plain_side(job, os.cpu_count() or 1)]
    result = {"config": {k: v for k, v in job.items() if k != "cache_dir"}, "tokens_per_step": tokens_per_step,
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "measured_plain": [dict(p, tokens_per_s=tokens_per_step / p["step_s"]) for p in plain],
              "profile_step_s_per_microbatch": {str(th): pr.step_s for th, pr in profiles.items()},
              "pipelines": {}}
    best_plain = min(p["step_s"] for p in plain)
    for world in a.ranks:
        th = rank_threads(world)
        real = spawn(job, world, tmp)
        sim = simulate_side(job, profiles[th], world, th, real.get("message_s", 0.0))
        rows = {}
        for name, r in real["schedules"].items():
            sm = sim[name]
            fixed = r["pre_s"] + r["post_s"]
            predicted = sm["shared_makespan_s"] + fixed
            rows[name] = {
                "measured_step_s": r["step_s"], "measured_tokens_per_s": tokens_per_step / r["step_s"],
                "simulated_step_s": predicted, "simulated_makespan_s": sm["shared_makespan_s"],
                "measured_fixed_pre_s": r["pre_s"], "measured_fixed_post_s": r["post_s"],
                "measured_schedule_span_s": r["schedule_span_s"],
                "measured_opt_s_per_rank": r["opt_s_per_rank"],
                "simulated_own_device_makespan_s": sm["own_device_makespan_s"],
                "simulated_uniform_speed": sm["uniform_speed"],
                "simulated_uniform_speed_makespan_s": sm["uniform_speed_makespan_s"],
                "measured_over_simulated": r["step_s"] / predicted,
                "measured_span_over_simulated_makespan": r["schedule_span_s"] / sm["shared_makespan_s"],
                "speedup_vs_best_plain": best_plain / r["step_s"],
                "losses_match_plain": max(abs(x - y) / abs(y) for x, y in zip(r["losses"], plain[0]["losses"])),
                "wait_s_per_rank": r["wait_s_per_rank"], "compute_s_per_rank": r["compute_s_per_rank"],
            }
        result["pipelines"][str(world)] = {"message_s": real.get("message_s"), "threads_per_rank": th,
                                           "schedules": rows}
    # the machine's load average (1 min) before and after: other jobs on the cores make every figure noisier
    result["load_average_before_after"] = [load_before[0], os.getloadavg()[0]]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))

    print(f"model {a.preset}, seq {a.seq_len}, micro-batch {a.micro_batch}, m = {a.m}: {tokens_per_step} tokens/step; "
          f"{os.cpu_count()} CPU cores")
    for p in result["measured_plain"]:
        print(f"  measured plain engine, {p['threads']} thread(s): {p['step_s'] * 1e3:8.1f} ms/step  "
              f"{p['tokens_per_s']:8.0f} tokens/s")
    for world, blk in result["pipelines"].items():
        print(f"  P = {world}, {blk['threads_per_rank']} thread(s) per rank "
              f"(one-way message {blk['message_s'] * 1e3:.2f} ms measured):")
        for name, r in blk["schedules"].items():
            print(f"    {name:14s} measured {r['measured_step_s'] * 1e3:8.1f} ms "
                  f"({r['measured_tokens_per_s']:7.0f} tok/s, ×{r['speedup_vs_best_plain']:.2f} vs best plain)  "
                  f"simulated {r['simulated_step_s'] * 1e3:8.1f} ms = makespan {r['simulated_makespan_s'] * 1e3:.1f}"
                  f" + measured fixed {(r['measured_fixed_pre_s'] + r['measured_fixed_post_s']) * 1e3:.1f}  "
                  f"measured/simulated {r['measured_over_simulated']:.2f}  "
                  f"(own-device makespan {r['simulated_own_device_makespan_s'] * 1e3:.1f}, uniform-speed "
                  f"{r['simulated_uniform_speed_makespan_s'] * 1e3:.1f}; measured schedule span "
                  f"{r['measured_schedule_span_s'] * 1e3:.1f})  loss rel diff {r['losses_match_plain']:.1e}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
