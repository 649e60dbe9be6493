"""SIMULATED benchmark: 16 GPT-2-family jobs (124M–1.5B) on 8 GPUs of 40 GB joined by PCIe — the makespan and
device utilisation of fifo, sharded-lrtf and planned, against the issue's goals (sharded-lrtf ≥ 1.5× fifo's
throughput, Hydra's headline; planned ≥ 1.3× sharded-lrtf's, Saturn's). Nothing is trained.

The cluster is a ``[hardware]`` table (:mod:`stratum.ir.hardware`, printed with the results). The jobs:
model.preset ∈ {gpt2-124m, gpt2-355m, gpt2-774m, gpt2-1.5b} × data.seq_len ∈ {512, 1024} × two learning rates
(same costs), micro-batch 4, 4 micro-batches per step, STEPS steps, fp32 with AdamW. Each model's bytes come from
:func:`stratum.profile.fast.shape_profile` (exact for these models, nothing computed); its block times are
*assumed*: FLOPs (2 per parameter per token, plus attention's 4·seq·d per token; backward twice the forward) at
TFLOPS per device — a stand-in for a profile on the GPU, the one number to change for another device.

The schedulers are :func:`stratum.sweep.cluster_sim.simulate_cluster`'s (what `stratum sweep simulate --hardware`
runs): fifo — each job on one GPU in sweep order, its fastest one-GPU strategy; sharded-lrtf — Hydra, every job
streaming its shards from the host, double-buffered (SHARD_BLOCKS: 0 = as many blocks as half a GPU holds beside
the job's activations, per job, as sweep.shard_blocks = 0 does), a freed GPU taking the task of the job
with the longest remaining time; planned — the joint MILP over each job's candidates (local, replicate(k),
pipeline(k) priced by :func:`stratum.plan.predict.predict`, offload), their GPUs and starts (CBC, TIME_LIMIT_S).
Beside them, Hydra's own comparator: the jobs one after another, each over all the GPUs with its fastest
strategy that uses them all (GPipe's pipeline(8) for every job here) — the sum of those options' seconds.

Runbook::

    python benchmarks/sweep_cluster_sim.py            # ≈ 1 min (shape tracing of four models, the MILP's limit)

Writes ``benchmarks/results/sweep_cluster_sim.json``.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import torch

from stratum.config import load_config
from stratum.ir.hardware import dump_hardware, hardware_from_table
from stratum.model.build import build_model
from stratum.profile.fast import shape_profile
from stratum.profile.profile import Profile
from stratum.sweep.cluster_sim import ClusterJob, simulate_cluster
from stratum.sweep.shard_size import AUTO
from stratum.sweep.strategies import streamed_tasks_s

HERE = Path(__file__).resolve().parent
CLUSTER = """
[hardware]
host_bytes = "1TB"
disk_bytes = "10TB"
host_link = { bandwidth = "25GB/s", latency = "10us" }     # PCIe 4 x16 to the host
disk_link = { bandwidth = "2GB/s", latency = "100us" }
intra_node = { bandwidth = "25GB/s", latency = "10us" }    # GPU to GPU over PCIe (no NVLink)
inter_node = { bandwidth = "25GB/s", latency = "10us" }
[[hardware.devices]]
name = "a100-40gb"
memory_bytes = "40GB"
count = 8
"""
PRESETS = ("gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b")
SEQ_LENS = (512, 1024)
LRS = (1e-4, 3e-4)
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 4, 100
TFLOPS = 50.0
SHARD_BLOCKS = AUTO
TIME_LIMIT_S = 30.0


def timed_profile(preset: str, seq_len: int) -> Profile:
    """The model's exact bytes (shapes) with block times from FLOPs at TFLOPS (the module's assumption)."""
    cfg = load_config(None, [f"model.preset={preset!r}"])
    model = build_model(cfg.model, tokenizer_vocab=50257, seq_len=seq_len, seed=0, device="meta")
    prof = shape_profile(model, micro_batch=MICRO_BATCH, seq_len=seq_len, device=torch.device("cpu"))
    tokens = MICRO_BATCH * seq_len
    d = model.blocks[1].attn.c_attn.weight.shape[1] if hasattr(model.blocks[1], "attn") else 0
    blocks = []
    for b in prof.blocks:
        if b.kind == "Layer":
            flops = 2 * b.n_params * tokens + 4 * seq_len * d * tokens
        elif b.kind == "Head":  # the tied projection onto the vocabulary
            flops = 2 * prof.blocks[0].n_params * tokens
        else:  # the embedding: a lookup
            flops = 0.0
        fwd = flops / (TFLOPS * 1e12)
        blocks.append(type(b)(**{**vars(b), "fwd_s": fwd, "bwd_s": 2 * fwd, "bwd_input_s": fwd}))
    return type(prof)(**{**vars(prof), "blocks": blocks})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "sweep_cluster_sim.json")
    args = ap.parse_args()
    hw = hardware_from_table(tomllib.loads(CLUSTER)["hardware"])
    profiles = {(p, s): timed_profile(p, s) for p in PRESETS for s in SEQ_LENS}
    jobs = {f"j{i:03d}": (p, s, lr) for i, (p, s, lr) in enumerate((p, s, lr) for p in PRESETS for s in SEQ_LENS
                                                                  for lr in LRS)}
    sim = simulate_cluster({j: ClusterJob(profile=profiles[p, s], microbatches=MICRO_BATCHES, steps=STEPS)
                            for j, (p, s, _) in jobs.items()}, hw, shard_blocks=SHARD_BLOCKS,
                           time_limit_s=TIME_LIMIT_S)
    options, plan = sim.options, sim.plan
    one_gpu = {j: min((o for o in opts.values() if o.devices == 1), key=lambda o: o.seconds)
               for j, opts in options.items()}
    hydra = {j: sum(streamed_tasks_s(profiles[p, s], hw, sim.shard_blocks[j])) * MICRO_BATCHES * STEPS
             for j, (p, s, _) in jobs.items()}
    spans = {name: r.makespan for name, r in sim.results.items()}
    every_gpu = {j: min(((name, o) for name, o in opts.items() if o.devices == hw.num_devices),
                        key=lambda x: x[1].seconds) for j, opts in options.items()}
    sequential = sum(o.seconds for _, o in every_gpu.values())  # one job at a time: the makespan is the sum
    result = {name: {"makespan_s": spans[name], "utilisation": sim.results[name].utilisation,
                     "throughput_vs_fifo": spans["fifo"] / spans[name]} for name in spans}
    goals = {"sharded-lrtf >= 1.5x fifo": result["sharded-lrtf"]["throughput_vs_fifo"] >= 1.5,
             "planned >= 1.3x sharded-lrtf": spans["sharded-lrtf"] / spans["planned"] >= 1.3}
    hydra_vs_sequential = sequential / spans["sharded-lrtf"]
    print("SIMULATED — nothing was run; block times are FLOPs at an assumed "
          f"{TFLOPS:g} TFLOP/s per GPU")
    print(dump_hardware(hw))
    print(f"{'job':5} {'model':10} {'seq':>5}  {'one GPU':>10} {'hydra':>10} {'shard':>5}  planned")
    for j, (p, s, _) in jobs.items():
        pl = plan.placed[j]
        print(f"{j:5} {p:10} {s:5d}  {one_gpu[j].seconds:9.1f}s {hydra[j]:9.1f}s {sim.shard_blocks[j]:5d}  "
              f"{pl.strategy} on "
              f"{len(pl.slots)} GPU(s), {pl.start:.0f}–{pl.end:.0f} s")
    for name, r in result.items():
        print(f"{name:13} makespan {r['makespan_s']:9.1f} s  utilisation {r['utilisation']:6.1%}  "
              f"{r['throughput_vs_fifo']:.2f}x fifo's throughput")
    print(f"one after another over all {hw.num_devices} GPUs ({', '.join(sorted({n for n, _ in every_gpu.values()}))}): "
          f"makespan {sequential:9.1f} s; sharded-lrtf {hydra_vs_sequential:.2f}x its throughput (Hydra's comparator)")
    print(f"planned: {plan.method}, {'optimal' if plan.optimal else 'not proved optimal'} in {plan.solve_s:.1f} s; "
          f"planned / sharded-lrtf throughput {spans['sharded-lrtf'] / spans['planned']:.2f}x")
    for goal, ok in goals.items():
        print(f"goal {goal}: {'met' if ok else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "simulated": True, "hardware": dump_hardware(hw), "tflops_assumed": TFLOPS, "steps": STEPS,
        "micro_batch": MICRO_BATCH, "micro_batches": MICRO_BATCHES, "shard_blocks": SHARD_BLOCKS,
        "jobs": {j: {"preset": p, "seq_len": s, "lr": lr, "one_gpu_s": one_gpu[j].seconds,
                     "hydra_s": hydra[j], "shard_blocks": sim.shard_blocks[j],
                     "options": {k: vars(o) for k, o in options[j].items()},
                     "planned": vars(plan.placed[j])} for j, (p, s, lr) in jobs.items()},
        "results": result, "sequential_every_gpu": {"makespan_s": sequential,
                                                    "strategies": {j: n for j, (n, _) in every_gpu.items()},
                                                    "sharded_lrtf_throughput_vs_it": hydra_vs_sequential},
        "planned_method": plan.method, "planned_optimal": plan.optimal,
        "goals": goals}, indent=2, default=list) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
