"""Kernel launches per step: the ATen operators one training step dispatches (``stratum.profile.launches``), the
plain engine beside the offload engine in three placements, on a CPU.

    python benchmarks/offload_launches.py --preset gpt2-124m --micro-batch 1 --seq-len 64 --grad-accum 2 \
        --out benchmarks/results/offload_launches.json

Placements: no budget (everything on the device, fp32 and bf16 autocast), and a device budget of 25 % of the
training state with the optimizer state on the host, fp32 and bf16 (bf16: 16-bit chunks, fp32 masters on the host;
their gradients handed to the host per tensor, a CPU's default, and per chunk, a GPU's: offload.grad_handoff).
Each count is one step's after one step of warm-up, each engine on a fresh copy of the model. These are the CPU's
dispatches: a GPU launches a kernel per dispatch (a ``_foreach_*`` or fused operator: one per ~100 tensors), but
the engine's work on its background threads (a GPU's side-stream copies) is not counted here, and no GPU ran.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections import Counter

import torch

from stratum.atomic import atomic_write_json
from stratum.config import load_config
from stratum.data.tokens import Batch
from stratum.model.build import build_model
from stratum.offload.engine import OffloadEngine
from stratum.offload.setup import placement_for
from stratum.profile.launches import copy_ops, ops_per_step
from stratum.runtime import optim_spec
from stratum.runtime.plain import PlainEngine

VOCAB = 256


def _batches(n: int, micro: int, seq: int) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, VOCAB, (micro, seq + 1), generator=g) for _ in range(n)]
    return [Batch(x=d[:, :-1].contiguous(), y=d[:, 1:].contiguous()) for d in data]


def _summary(ops: Counter[str], plain: Counter[str] | None) -> dict:
    out: dict = {"ops": sum(ops.values()), "copies": copy_ops(ops)}
    if plain is not None:
        out["over_plain"] = out["ops"] / sum(plain.values())
        extra = (ops - plain).most_common(8)
        out["more_than_plain"] = dict(extra)
        out["fewer_than_plain"] = dict((plain - ops).most_common(4))
    return out


def count(args) -> dict:
    dev = torch.device("cpu")
    base = [f"model.preset={args.preset!r}", f"model.vocab_size={VOCAB}", f"data.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}", f"train.grad_accum={args.grad_accum}"]
    batches = _batches(args.grad_accum, args.micro_batch, args.seq_len)
    results: dict = {}
    for prec in ("fp32", "bf16"):
        cfg = load_config(None, [*base, f"train.precision={prec!r}"])
        model = build_model(cfg.model, tokenizer_vocab=VOCAB, seq_len=args.seq_len, seed=0)
        plain = ops_per_step(PlainEngine(copy.deepcopy(model), optim=optim_spec(cfg), device=dev, precision=prec),
                             batches, 1e-4)
        results[f"plain {prec}"] = _summary(plain, None)
        budget = str(16 * model.num_params() // 4)
        streamed = [f"offload.device_budget={budget!r}", "offload.optimizer_tier='host'"]
        placements = [("no budget", []), ("25 % budget, host optimizer", streamed)]
        if prec == "bf16":
            placements.append(("25 % budget, host optimizer, gradients per chunk",
                               [*streamed, "offload.grad_handoff='chunk'"]))
        for name, extra in placements:
            ocfg = load_config(None, [*base, f"train.precision={prec!r}", *extra])
            m = copy.deepcopy(model)
            plan = placement_for(ocfg, m, dev)
            eng = OffloadEngine(m, optim=optim_spec(ocfg), device=dev, placement=plan, precision=prec)
            try:
                ops = ops_per_step(eng, batches, 1e-4)
            finally:
                eng.close()
            res = _summary(ops, plain)
            res.update(chunks=plan.n_chunks, resident_chunks=plan.resident_chunks, half_params=plan.half_params,
                       chunk_grads=plan.chunk_grads, activations=plan.activations)
            results[f"offload {name} {prec}"] = res
            print(f"{name} {prec}: {res['ops']} ops against plain's {sum(plain.values())}", flush=True)
    return {"preset": args.preset, "params": model.num_params(), "micro_batch": args.micro_batch,
            "seq_len": args.seq_len, "grad_accum": args.grad_accum, "vocab": VOCAB, "counts": results,
            "load_average": os.getloadavg(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = count(args)
    print(json.dumps(out, indent=1))
    if args.out:
        atomic_write_json(args.out, out)


if __name__ == "__main__":
    main()
