"""Benchmark (SIMULATED): the cluster simulator's policies side by side on the same hardware and traces.

Two studies, every figure a prediction of Stratum's cost model (block times from each block's kernel count and
FLOPs on the device model of :mod:`stratum.ir.work`; ring all-reduce prices), never a measurement:

- ``deeppool``: DeepPool's setting. A foreground job strong-scaled over N ∈ {8, 16, 32, 64} GPUs (gpt2-774m, a
  fixed global batch of 64 sequences) and a queue of background jobs (4·N single-GPU gpt2-124m jobs, 8 sequences
  a step), everything submitted at once; the cluster's throughput over the first hour — seconds of training work
  done per second, in profiled-device seconds, summed over jobs — under ``static-dp`` (the foreground data
  parallel on all N, the background waits), ``burst`` and ``burst+multiplex``, for amplification limits 2, 4 and 8
  (the knob that trades the foreground's speed for idle devices). Goal (DeepPool's figure): ≥ 2.2× static-dp's
  with burst+multiplex, at about the same foreground speed (its ratio is reported too).
- ``vgg``: the same with a VGG-16 foreground (DeepPool's own example: convolutions with most of the FLOPs and
  few parameters, fully connected layers with most of the parameters and few FLOPs), 64 images a step; its
  kernels and FLOPs counted like GPT's, its work reported in the same unit (its FLOPs at 50 GFLOP/s).
- ``elastic``: a generated Philly-like trace (``stratum.cluster.generate``: Gavel's Philly sizes and durations,
  Poisson arrivals at load 1 and 2) on 64 GPUs, replayed under ``static-dp``, ``elastic`` and ``elastic-devices``
  (Saxena et al.'s own baseline: devices re-allocated, batch fixed); jobs completed by the last arrival and
  average job completion time with every job run to the end; a resize pays a checkpoint-restart (the training
  state over the host link twice and a 30 s start-up). Goals (the issue's, against static-dp): ≥ 2× the jobs
  completed and ≥ 5× lower average JCT; the paper's "up to ≈2× / ≈10×" are against elastic-devices, reported too.
  Median over three trace seeds per load.

The hardware: 64 GPUs, 8 to a node, 80 GB each, sustaining 150 TFLOP/s on large kernels (an A100's 312 TFLOP/s
bf16 dense peak at the 44–52 % Megatron-LM reaches training GPTs on A100s, Narayanan et al., SC 2021), a 5 µs
launch latency per kernel and Hockney's half-performance work per kernel at peak × launch latency (750 MFLOP),
300 GB/s inside a node and 25 GB/s between nodes (:data:`stratum.ir.hardware.NOMINAL_INTRA` / ``NOMINAL_INTER``),
the host at 25 GB/s (``NOMINAL_HOST``). ``speed`` 3000 (× the profiled CPU thread) only converts the training
work into the report's profiled-device seconds.

Runbook::

    python benchmarks/cluster_bench.py                 # both studies, a few minutes once the models are cached
    python benchmarks/cluster_bench.py --study deeppool --out /tmp/c.json

The first run measures gpt2-124m … gpt2-1.5b's blocks on one CPU thread (a few minutes, cached). Writes
``benchmarks/results/cluster.json`` and ``benchmarks/results/cluster_elastic.png``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from stratum.atomic import atomic_write_json
from stratum.cluster.cluster import pick
from stratum.cluster.generate import TraceSpec, generate
from stratum.cluster.models import ModelCosts, counted_costs
from stratum.cluster.replay import PolicyConfig, replay, trace_costs
from stratum.cluster.report import summary, write_png
from stratum.cluster.scaling import burst_step, dp_step
from stratum.cluster.trace import Job
from stratum.config import Config
from stratum.ir.hardware import Hardware
from stratum.model.blockseq import BlockSeq, ModelInfo

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "cluster.json"
SPEED = 3000.0
GPU_BYTES = 80 * 10**9
PEAK_FLOPS = 150e12
"""Sustained FLOP/s of one GPU on large kernels (see the module docstring)."""
LAUNCH_S = 5e-6
"""Seconds per kernel launch (CUDA's launch latency, about 5 µs)."""
HORIZON_S = 3600.0


def hardware(n: int) -> Hardware:
    hw = Hardware.uniform(n, memory_bytes=GPU_BYTES, speed=SPEED, per_node=8, name="gpu")
    return replace(hw, devices=tuple(replace(d, peak_flops=PEAK_FLOPS, launch_s=LAUNCH_S) for d in hw.devices))


def vgg16() -> BlockSeq:
    """VGG-16 (Simonyan & Zisserman, 2015) on meta, as DeepPool's foreground: five convolution stages (few
    parameters, most of the FLOPs) and three fully connected layers (most of the parameters, few FLOPs), a block
    each; 224 × 224 images, 1000 classes."""
    layers: list[nn.Module] = []
    blocks: list[nn.Module] = []
    channels = 3
    with torch.device("meta"):
        for width, convs in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
            for _ in range(convs):
                layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
                channels = width
            blocks.append(nn.Sequential(*layers, nn.MaxPool2d(2)))
            layers = []
        blocks += [nn.Sequential(nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU()),
                   nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()), nn.Linear(4096, 1000)]
    return BlockSeq(blocks, F.cross_entropy, ModelInfo(name="vgg16"))


def vgg16_costs() -> ModelCosts:
    """VGG-16's costs: counted, its work in the unit of the profiled GPT blocks (FLOPs at the GPUs' peak over
    their speed: 50 GFLOP/s, about what the profiled CPU thread sustains on GPT-2)."""
    x = torch.empty(1, 3, 224, 224, device="meta")
    y = torch.zeros(1, dtype=torch.long, device="meta")
    return counted_costs(vgg16(), x, y, reference_flops=PEAK_FLOPS / SPEED)


def deeppool_jobs(n: int, model: str) -> list[Job]:
    fg = Job(id="fg", arrival_s=0.0, model=model, batch=64, steps=10**7, devices=n, priority="foreground")
    bg = [Job(id=f"bg{i:03d}", arrival_s=0.0, model="gpt2-124m", batch=8, steps=10**6, devices=1)
          for i in range(4 * n)]
    return [fg, *bg]


def runs(widths: tuple[int, ...]) -> str:
    """Widths as runs: ``1, 8×36, 64``."""
    out: list[list[int]] = []
    for w in widths:
        if out and out[-1][0] == w:
            out[-1][1] += 1
        else:
            out.append([w, 1])
    return ", ".join(f"{w}×{c}" if c > 1 else str(w) for w, c in out)


def deeppool(config: PolicyConfig, cache: Path, amplifications: list[float], model: str,
             counted: dict[tuple[str, int], ModelCosts]) -> list[dict]:
    """DeepPool's setting with a ``model`` foreground (its costs in ``counted`` unless a GPT preset)."""
    rows = []
    for amp, n in [(a, n) for a in amplifications for n in (8, 16, 32, 64)]:
        config = replace(config, amplification=amp)
        jobs = deeppool_jobs(n, model)
        costs = trace_costs([j for j in jobs if (j.model, j.seq_len) not in counted], cache) | counted
        res = replay(hardware(n), jobs, costs, ["static-dp", "burst", "burst+multiplex"], config=config,
                     until_s=HORIZON_S)
        plan = burst_step(costs[(jobs[0].model, jobs[0].seq_len)], batch=jobs[0].batch, ranks=range(n),
                          hw=hardware(n), amplification=amp)
        rate = {r.policy: summary(r)["work_rate"] for r in res}
        fg = {r.policy: next(j for j in r.jobs if j.id == "fg").done for r in res}
        rows.append({"amplification": amp, "devices": n, "work_rate": rate, "foreground_done": fg,
                     "throughput_ratio": rate["burst+multiplex"] / rate["static-dp"],
                     "foreground_speed_ratio": fg["burst+multiplex"] / fg["static-dp"],
                     "burst_foreground_speed_ratio": fg["burst"] / fg["static-dp"],
                     "foreground_widths": runs(plan.plan.widths), "foreground_step_s": plan.step_s,
                     "foreground_exposed_allreduce_s": plan.exposed_s,
                     "foreground_idle_share": plan.idle_s / (n * plan.step_s)})
        print(f"deeppool {model} amplification {amp:g}, N={n:>2}: cluster throughput burst+multiplex / static-dp = "
              f"{rows[-1]['throughput_ratio']:.2f}x; foreground speed {rows[-1]['foreground_speed_ratio']:.2f}x "
              f"(burst alone "
              f"{rows[-1]['burst_foreground_speed_ratio']:.2f}x)  widths {rows[-1]['foreground_widths']}  SIMULATED", flush=True)
    return rows


def elastic(config: PolicyConfig, cache: Path, jobs_per_trace: int, load: float, png: Path | None) -> dict:
    hw = hardware(64)
    seeds = []
    for seed in (0, 1, 2):
        costs: dict = {}

        def step_s(job: Job) -> float:  # called by generate in this iteration only: this seed's costs
            costs.update(trace_costs([job], cache))  # noqa: B023
            ranks = pick(hw, range(hw.num_devices), job.devices)
            return dp_step(costs[(job.model, job.seq_len)], batch=job.batch, ranks=ranks, hw=hw).step_s  # noqa: B023

        jobs = generate(TraceSpec(jobs=jobs_per_trace, seed=seed, devices=64, load=load), step_s)
        horizon = jobs[-1].arrival_s
        t0 = time.perf_counter()
        policies = ["static-dp", "elastic", "elastic-devices"]
        full = replay(hw, jobs, costs, policies, config=config)
        cut = replay(hw, jobs, costs, policies, config=config, until_s=horizon)
        s = {r.policy: summary(r) for r in full}
        c = {r.policy: summary(r)["completed"] for r in cut}
        seeds.append({"seed": seed, "jobs": len(jobs), "horizon_s": horizon, "completed_by_horizon": c,
                      "avg_jct_s": {p: v["avg_jct_s"] for p, v in s.items()},
                      "p95_jct_s": {p: v["p95_jct_s"] for p, v in s.items()},
                      "utilisation": {p: v["utilisation"] for p, v in s.items()},
                      **{f"{key}_ratio{'' if base == 'static-dp' else '_vs_devices'}": value
                         for base in ("static-dp", "elastic-devices")
                         for key, value in (("completed", c["elastic"] / max(c[base], 1)),
                                            ("jct", s[base]["avg_jct_s"] / s["elastic"]["avg_jct_s"]))},
                      "simulate_s": time.perf_counter() - t0})
        print(f"elastic load {load:g} seed {seed}: jobs completed by the last arrival static-dp {c['static-dp']}, "
              f"elastic-devices {c['elastic-devices']}, elastic {c['elastic']}; average JCT "
              f"{s['static-dp']['avg_jct_s'] / 3600:.1f} h, {s['elastic-devices']['avg_jct_s'] / 3600:.1f} h, "
              f"{s['elastic']['avg_jct_s'] / 3600:.1f} h  SIMULATED", flush=True)
        if png and seed == 0:
            write_png(png, full, title=f"{len(jobs)} Philly-like jobs on 64 GPUs (load {load:g}, seed 0)")
    keys = ("completed_ratio", "jct_ratio", "completed_ratio_vs_devices", "jct_ratio_vs_devices")
    return {"load": load, "seeds": seeds, **{f"median_{k}": statistics.median(s[k] for s in seeds) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", choices=("all", "deeppool", "vgg", "elastic"), default="all")
    ap.add_argument("--jobs", type=int, default=200, help="jobs per generated trace (default 200)")
    ap.add_argument("--amplification", default="2,4,8", help="deeppool: amplification limits (default 2,4,8)")
    ap.add_argument("--load", default="1,2", help="elastic: trace loads (default 1,2)")
    ap.add_argument("--interference", type=float, default=PolicyConfig().interference)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    config = PolicyConfig(interference=args.interference)
    amps = [float(a) for a in args.amplification.split(",")]
    cache = Config().cache_dir
    doc = {"label": "SIMULATED", "hardware": {"gpus_per_node": 8, "gpu_bytes": GPU_BYTES, "speed": SPEED,
                                              "peak_flops": PEAK_FLOPS, "launch_s": LAUNCH_S,
                                              "intra_node_Bps": hardware(8).intra_node.bandwidth,
                                              "inter_node_Bps": hardware(8).inter_node.bandwidth},
           "interference": config.interference, "restart_startup_s": config.startup_s}
    if args.study in ("all", "deeppool"):
        doc["deeppool"] = deeppool(config, cache, amps, "gpt2-774m", {})
    if args.study in ("all", "vgg"):
        doc["deeppool_vgg16"] = deeppool(config, cache, amps, "vgg16", {("vgg16", 1024): vgg16_costs()})
    if args.study in ("all", "elastic"):
        png = args.out.parent / "cluster_elastic.png" if args.out == DEFAULT_OUT else args.out.with_suffix(".png")
        doc["elastic"] = []
        for i, load in enumerate(float(x) for x in args.load.split(",")):
            doc["elastic"].append(elastic(config, cache, args.jobs, load, png if i == 0 else None))
            med = doc["elastic"][-1]
            print(f"elastic load {load:g}, medians: jobs completed {med['median_completed_ratio']:.2f}x static-dp's, "
                  f"{med['median_completed_ratio_vs_devices']:.2f}x elastic-devices'; average JCT "
                  f"{med['median_jct_ratio']:.2f}x / {med['median_jct_ratio_vs_devices']:.2f}x lower  SIMULATED",
                  flush=True)
    atomic_write_json(args.out, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
