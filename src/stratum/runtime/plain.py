"""The plain engine: the whole model on one device, torch autograd, torch AdamW. The reference every other
engine must reproduce."""

from __future__ import annotations

import math

import torch

from stratum.data.tokens import Batch
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import buffers_to_cpu, load_buffers
from stratum.runtime.device import autocast, peak_memory_bytes
from stratum.runtime.engine import Engine, OptimSpec, StepResult, TrainState
from stratum.runtime.optim import export_state, load_train_state, make_adamw


class PlainEngine(Engine):
    name = "plain"

    def __init__(self, model: BlockSeq, *, optim: OptimSpec, device: torch.device, precision: str = "fp32"):
        self.device = device
        self.precision = precision
        self.spec = optim
        self.model = model.to(device)
        self.named = list(self.model.named_parameters())
        self.params = [p for _, p in self.named]
        self.opt = make_adamw(self.named, optim, device)

    def _loss(self, b: Batch) -> torch.Tensor:
        x = b.x.to(self.device, non_blocking=True)
        y = b.y.to(self.device, non_blocking=True)
        with autocast(self.device, self.precision):
            return self.model.loss(x, y)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        self.model.train()
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for b in micro_batches:
            loss = self._loss(b)
            (loss / n).backward()
            total += loss.detach().float()
        clip = self.spec.grad_clip if self.spec.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip, foreach=True)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepResult(loss=total.item() / n, grad_norm=float(grad_norm))

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        self.model.eval()
        total = sum(float(self._loss(b)) for b in batches)
        return total / len(batches)

    def state(self) -> TrainState:
        return TrainState(params={n: p.detach().to("cpu", copy=True) for n, p in self.named},
                          optim=export_state(self.opt, self.named), buffers=buffers_to_cpu(self.model))

    def load_state(self, state: TrainState) -> None:
        load_train_state(self.opt, self.named, state)
        load_buffers(self.model, state.buffers)

    def memory_stats(self) -> dict[str, int]:
        return {"peak_device_bytes": peak_memory_bytes(self.device)}
