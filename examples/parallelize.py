"""Your own model and loop on a Stratum plan: the three lines marked ``# stratum``.

Runbook
-------
One process:            python examples/parallelize.py --plan local
4 processes, here:      stratum run --nproc 4 examples/parallelize.py --plan "replicate(2, pipeline(2))"
the same with torchrun: torchrun --nproc_per_node 4 examples/parallelize.py --plan "replicate(2, pipeline(2))"
2 machines × 2:         torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
                            examples/parallelize.py --plan "replicate(2, pipeline(2))"

The model is a small causal language model written as an ``nn.Sequential``; the data are bytes of this file's own
standard library (real text, nothing downloaded), the same batches on every process.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import torch
from torch import nn

import stratum  # stratum


class CausalMix(nn.Module):
    """x + MLP(causal running mean of x): a tiny token mixer that keeps the example short."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mean = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device).view(1, -1, 1)
        return x + self.mlp(torch.cat([h, mean], dim=-1))


def make_model(vocab: int = 256, d: int = 64, layers: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(vocab, d), *[CausalMix(d) for _ in range(layers)], nn.LayerNorm(d),
                         nn.Linear(d, vocab))


def batches(steps: int, batch: int, seq: int, seed: int = 0):
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        rows = torch.stack([data[s:s + seq + 1] for s in starts])
        yield rows[:, :-1], rows[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", default="local")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", help="write the losses as JSON here (rank 0)")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = make_model()
    engine = stratum.parallelize(model, plan=a.plan, lr=3e-3, micro_batches=2)  # stratum
    losses = []
    for step, (x, y) in enumerate(batches(a.steps, a.batch, seq=64)):
        losses.append(engine.step(x, y))  # stratum
        if engine.is_main and step % 5 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    if engine.is_main and a.out:
        Path(a.out).write_text(json.dumps(losses))
    engine.close()


if __name__ == "__main__":
    try:
        main()
    except stratum.StratumError as e:  # bad input (a plan, a process count): one line, not a traceback
        print(f"stratum: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)  # 2 for bad input (3: a peer process was lost), as the stratum command exits
