"""SIMULATED benchmark: 16 GPT-2-family jobs (124M–1.5B) on 8 GPUs of 40 GB joined by PCIe — the makespan and
device utilisation of fifo, sharded-lrtf and planned, against the issue's goals (sharded-lrtf ≥ 1.5× fifo's
throughput, Hydra's headline; planned ≥ 1.3× sharded-lrtf's, Saturn's). Nothing is trained.

The cluster is a ``[hardware]`` table (:mod:`stratum.ir.hardware`, printed with the results). The jobs:
model.preset ∈ {gpt2-124m, gpt2-355m, gpt2-774m, gpt2-1.5b} × data.seq_len ∈ {512, 1024} × two learning rates
(same costs), micro-batch 4, 4 micro-batches per step, STEPS steps, fp32 with AdamW. Each model's bytes come from
:func:`stratum.profile.fast.shape_profile` (exact for these models, nothing computed); its block times are
*assumed*: FLOPs (2 per parameter per token, plus attention's 4·seq·d per token; backward twice the forward) at
TFLOPS per device — a stand-in for a profile on the GPU, the one number to change for another device.

- fifo: each job on one GPU in sweep order, its fastest one-GPU strategy (plain where its state and activations
  fit 40 GB, else offload).
- sharded-lrtf: Hydra: every job streams its shards from the host (a shard = SHARD_BLOCKS blocks; a task = one
  shard's forward or backward for one micro-batch), double-buffered
  (:func:`stratum.sweep.strategies.streamed_tasks_s`); a freed GPU takes the task of the job with the longest
  remaining time (:func:`stratum.sweep.shard_lrtf.sharded_lrtf`).
- planned: every job's candidate strategies — local, replicate(k), pipeline(k) for k ≤ 8 priced by
  :func:`stratum.plan.predict.predict`, offload where nothing on one GPU fits — and the joint MILP over strategy,
  GPUs and start (:func:`stratum.sweep.gang.plan_gang`, CBC, TIME_LIMIT_S).

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
from stratum.ir.hardware import Hardware, dump_hardware, hardware_from_table
from stratum.model.build import build_model
from stratum.profile.fast import shape_profile
from stratum.profile.profile import Profile
from stratum.sweep.gang import Option, plan_gang
from stratum.sweep.shard_lrtf import makespan, sharded_lrtf
from stratum.sweep.simulate import simulate
from stratum.sweep.strategies import job_options, streamed_tasks_s

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
SHARD_BLOCKS = 8
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


def hydra_chain(prof: Profile, hw: Hardware) -> list[float]:
    """A job's shard tasks as Hydra runs them (:func:`stratum.sweep.strategies.streamed_tasks_s`), all steps."""
    return streamed_tasks_s(prof, hw, SHARD_BLOCKS) * (MICRO_BATCHES * STEPS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "sweep_cluster_sim.json")
    args = ap.parse_args()
    hw = hardware_from_table(tomllib.loads(CLUSTER)["hardware"])
    n = hw.num_devices
    profiles = {(p, s): timed_profile(p, s) for p in PRESETS for s in SEQ_LENS}
    jobs = {f"j{i:03d}": (p, s, lr) for i, (p, s, lr) in enumerate((p, s, lr) for p in PRESETS for s in SEQ_LENS
                                                                  for lr in LRS)}
    options = {j: job_options(profiles[p, s], microbatches=MICRO_BATCHES, steps=STEPS, hw=hw, max_devices=n,
                          shard_blocks=SHARD_BLOCKS)
               for j, (p, s, _) in jobs.items()}
    one_gpu = {j: min((o for o in opts.values() if o.devices == 1), key=lambda o: o.seconds)
               for j, opts in options.items()}
    fifo = simulate("fifo", {j: 1 for j in jobs}, {j: o.seconds for j, o in one_gpu.items()}, slots=n)
    chains = {j: hydra_chain(profiles[p, s], hw) for j, (p, s, _) in jobs.items()}
    hydra = {j: sum(c) for j, c in chains.items()}
    tasks = sharded_lrtf(chains, n)
    plan = plan_gang(options, [0.0] * n, time_limit_s=TIME_LIMIT_S)
    busy = {"fifo": sum(o.seconds for o in one_gpu.values()),
            "sharded-lrtf": sum(sum(c) for c in chains.values()),
            "planned": sum(options[j][p.strategy].seconds * len(p.slots) for j, p in plan.placed.items())}
    spans = {"fifo": fifo.makespan, "sharded-lrtf": makespan(tasks), "planned": plan.makespan}
    result = {name: {"makespan_s": spans[name], "utilisation": busy[name] / (n * spans[name]),
                     "throughput_vs_fifo": spans["fifo"] / spans[name]} for name in spans}
    goals = {"sharded-lrtf >= 1.5x fifo": result["sharded-lrtf"]["throughput_vs_fifo"] >= 1.5,
             "planned >= 1.3x sharded-lrtf": spans["sharded-lrtf"] / spans["planned"] >= 1.3}
    print("SIMULATED — nothing was run; block times are FLOPs at an assumed "
          f"{TFLOPS:g} TFLOP/s per GPU")
    print(dump_hardware(hw))
    print(f"{'job':5} {'model':10} {'seq':>5}  {'one GPU':>10} {'hydra':>10}  planned")
    for j, (p, s, _) in jobs.items():
        pl = plan.placed[j]
        print(f"{j:5} {p:10} {s:5d}  {one_gpu[j].seconds:9.1f}s {hydra[j]:9.1f}s  {pl.strategy} on "
              f"{len(pl.slots)} GPU(s), {pl.start:.0f}–{pl.end:.0f} s")
    for name, r in result.items():
        print(f"{name:13} makespan {r['makespan_s']:9.1f} s  utilisation {r['utilisation']:6.1%}  "
              f"{r['throughput_vs_fifo']:.2f}x fifo's throughput")
    print(f"planned: {plan.method}, {'optimal' if plan.optimal else 'not proved optimal'} in {plan.solve_s:.1f} s; "
          f"planned / sharded-lrtf throughput {spans['sharded-lrtf'] / spans['planned']:.2f}x")
    for goal, ok in goals.items():
        print(f"goal {goal}: {'met' if ok else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "simulated": True, "hardware": dump_hardware(hw), "tflops_assumed": TFLOPS, "steps": STEPS,
        "micro_batch": MICRO_BATCH, "micro_batches": MICRO_BATCHES, "shard_blocks": SHARD_BLOCKS,
        "jobs": {j: {"preset": p, "seq_len": s, "lr": lr, "one_gpu_s": one_gpu[j].seconds,
                     "hydra_s": hydra[j],
                     "options": {k: vars(o) for k, o in options[j].items()},
                     "planned": vars(plan.placed[j])} for j, (p, s, lr) in jobs.items()},
        "results": result, "planned_method": plan.method, "planned_optimal": plan.optimal,
        "goals": goals}, indent=2, default=list) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
