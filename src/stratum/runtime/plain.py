"""The plain engine: the whole model on one device, torch autograd, torch AdamW. The reference every other
engine must reproduce."""

from __future__ import annotations

import torch
from torch import nn

from stratum.data.tokens import Batch
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import buffers_to_cpu, evaluating, load_buffers
from stratum.runtime.device import autocast, peak_memory_bytes
from stratum.runtime.engine import GradEngine, OptimSpec, StepResult, TrainState, clip_coef
from stratum.runtime.loss_scale import LossScaleSpec, ScaledAdamW
from stratum.runtime.optim import MakeOptimizer, leaf_optimizer, load_params
from stratum.runtime.tensors import full_tensor


class PlainEngine(GradEngine):
    name = "plain"
    grads_final_in_backward = True  # one autograd backward per micro-batch, nothing added after it

    def __init__(self, model: BlockSeq, *, optim: OptimSpec, device: torch.device, precision: str = "fp32",
                 make_optimizer: MakeOptimizer | None = None, loss_scale: LossScaleSpec | None = None):
        self.device = device
        self.precision = precision
        self.spec = optim
        self.model = model.to(device)
        self.named = list(self.model.named_parameters())
        self.params = [p for _, p in self.named]
        self.scaled: ScaledAdamW | None = None
        """fp16: the optimizer, stepped through torch's GradScaler (runtime/loss_scale.py); None otherwise."""
        if precision == "fp16":
            if make_optimizer is not None:
                raise StratumError("train.precision = 'fp16' runs on one process (the plain or offload engine); "
                                   "this plan's optimizer is shared between processes: use bf16 or fp32")
            self.scaled = ScaledAdamW(self.named, optim, device, loss_scale or LossScaleSpec())
        self.opt = self.scaled or leaf_optimizer(make_optimizer, self.named, optim, device)

    def _loss(self, b: Batch) -> torch.Tensor:
        x = b.x.to(self.device, non_blocking=True)
        y = b.y.to(self.device, non_blocking=True)
        with autocast(self.device, self.precision):
            return self.model.loss(x, y, b.stream if self.model.training else None)

    def forward_backward(self, micro_batches: list[Batch], divisor: int) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for b in micro_batches:
            loss = self._loss(b)
            part = loss / divisor
            (part if self.scaled is None else self.scaled.scaler.scale(part)).backward()
            total += loss.detach().float()
        return total.double()

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        if self.scaled is None:
            return super().train_step(micro_batches, lr)
        n, scale = len(micro_batches), self.scaled.scaler.get_scale()
        loss_sum = self.forward_backward(micro_batches, n)
        self.scaled.unscale()  # before the norm: clipping sees the true gradients
        norm = self.grad_norm()
        self.update(lr, clip_coef(norm, self.spec.grad_clip))
        return StepResult(loss=float(loss_sum) / n, grad_norm=float(norm), loss_scale=scale,
                          skipped=self.scaled.skipped)

    def grad_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.named

    def norm_counted(self) -> set[str]:
        return {n for n, _ in self.named}

    def reduce_norm(self, norms: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(norms)  # clip_grad_norm_'s total norm

    def update(self, lr: float, coef: torch.Tensor) -> None:
        self.opt.step(lr, coef)

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        with evaluating([self.model]):
            total = sum(float(self._loss(b)) for b in batches)
        return total / len(batches)

    def state(self) -> TrainState:
        return TrainState(params={n: full_tensor(p) for n, p in self.named}, optim=self.opt.export(),
                          buffers=buffers_to_cpu(self.model),
                          scaler=self.scaled.scaler_state() if self.scaled is not None else {})

    def load_state(self, state: TrainState) -> None:
        load_params(self.named, state)
        self.opt.load(state.optim)
        if self.scaled is not None:
            self.scaled.load_scaler(state.scaler)
        load_buffers(self.model, state.buffers)

    def memory_stats(self) -> dict[str, int]:
        return {"peak_device_bytes": peak_memory_bytes(self.device), "optim_state_bytes": self.opt.state_bytes()}
