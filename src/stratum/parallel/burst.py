"""The burst node: DeepPool's burst parallelism run for real — block i on the first ``widths[i]`` processes.

Every process draws the step's micro-batches (the same list on every rank). For each micro-batch of B samples:

1. block i runs on ranks 0 … k−1 (k = ``widths[i]``), rank r on its contiguous share of the samples
   (:func:`stratum.plan.burst.spans`); block 0 slices its share of the token ids directly;
2. between blocks of different widths the boundary activation is moved point to point: each sample range goes
   from the rank that computed it to the rank that runs it next (a scatter when the next block is wider, a
   gather when it is narrower; :func:`stratum.plan.burst.overlaps` lists the messages), its gradient comes back
   the same way in the backward;
3. the last block's ranks compute their share's mean loss weighted by share/B, so the shares' losses — and the
   gradients they back-propagate — add up to the whole micro-batch's mean, as the plain engine computes it;
4. the backward runs block by block, last to first, on the same ranks.

After the step's micro-batches each parameter's gradient is summed over the ranks that ran a block using it
(the first k of them, k the largest width of those blocks; one flat all-reduce per width), so those ranks hold
the plain engine's gradient and apply the same AdamW update. Rank r holds only the blocks wider than r (the
others are freed to ``meta``); rank 0 holds every block, so it computes the gradient norm, evaluates, and saves
the training state. Ranks outside a block's width idle through it: the time multiplexing can fill.

Refused: dropout (a rank's share would draw other masks than the plain engine's whole-batch draw) and batch
normalisation (statistics over a share differ from the whole batch's), each only in training mode (in eval mode
they draw no masks and use running statistics); a micro-batch smaller than the widest
block. Every wait is bounded by the world's timeout.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

from stratum.data.tokens import Batch
from stratum.dist.world import World
from stratum.errors import StratumError
from stratum.ir.plan import Burst, render
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import buffers_to_cpu, evaluating, load_buffers
from stratum.model.placement import localize
from stratum.model.streams import block_stream, dropout_site
from stratum.parallel import presence
from stratum.plan.burst import BurstPlan, overlaps, spans
from stratum.runtime.device import autocast, peak_memory_bytes
from stratum.runtime.engine import GradEngine, OptimSpec, TrainState
from stratum.runtime.optim import leaf_optimizer, load_params
from stratum.runtime.tensors import HEADER_LEN, WIRE_DTYPES, full_tensor, header_shape, tensor_header


def check_burst_model(model: BlockSeq, node: Burst, micro_batch: int) -> None:
    """Refuse, in one line, a model or batch the burst node cannot run with the plain engine's losses."""
    widths = node.width_list()
    where = f"parallel.plan {render(node)!r}"
    if widths and len(widths) != len(model):
        raise StratumError(f"{where}: widths gives {len(widths)} numbers but the model has {len(model)} blocks; "
                           "give one per block")
    widest = max(widths) if widths else node.n
    if micro_batch < widest:
        raise StratumError(f"{where}: a micro-batch of {micro_batch} sequences cannot be split over {widest} "
                           f"processes; raise train.micro_batch_size to at least {widest}")
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:  # (in eval mode: running stats)
            raise StratumError(f"{where}: {name} is a batch norm, whose statistics over a process's share of the "
                               "samples differ from the whole batch's; burst cannot run it")
    if site := dropout_site(model):
        raise StratumError(f"{where}: {site[0]} drops out (p = {site[1]:g}); burst splits a micro-batch's samples "
                           "over processes, whose masks would differ from the plain engine's — set model.dropout = 0")


def prefix_groups(widths: tuple[int, ...], timeout_s: float) -> dict[int, object]:
    """Width k → the group of ranks 0 … k−1, for every width over 1 in ``widths``. ``new_group`` is collective:
    every process of the default group calls this with the same widths, also one that takes no part."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return {k: dist.new_group(list(range(k)), timeout=timeout) for k in sorted(set(widths)) if k > 1}


def _param_widths(model: BlockSeq, widths: tuple[int, ...]) -> dict[str, int]:
    """Canonical parameter name → the largest width of the blocks using it (its reduction group)."""
    out: dict[str, int] = {}
    for i in range(len(model)):
        for name in model.block_param_names(i):
            out[name] = max(out.get(name, 0), widths[i])
    return out


class BurstEngine(GradEngine):
    """Runs ``model`` with block i on the first ``widths[i]`` ranks of ``world`` (see the module docstring)."""

    name = "burst"

    def __init__(self, model: BlockSeq, *, widths: tuple[int, ...], optim: OptimSpec, world: World,
                 precision: str = "fp32", plan: BurstPlan | None = None, microbatches: int = 1):
        self.world, self.spec, self.precision, self.plan = world, optim, precision, plan
        self.microbatches = microbatches
        """Micro-batches per step, for the plan's prediction."""
        self.n, self.rank = world.size("replica"), world.coord.replica
        if len(widths) != len(model) or any(not 1 <= w <= self.n for w in widths):
            raise StratumError(f"burst widths {widths} must give one width in 1..{self.n} per block "
                               f"({len(model)} blocks)")
        self.widths = tuple(widths)
        self.device = world.device
        self.held = [i for i, w in enumerate(widths) if w > self.rank]
        self.model = localize(model, set(self.held), self.device)
        width_of = _param_widths(model, self.widths)
        canonical = dict(model.named_parameters())
        self.named = [(n, canonical[n]) for n in canonical if width_of[n] > self.rank]
        self.by_width: dict[int, list[nn.Parameter]] = {}
        for n, p in self.named:
            if p.requires_grad:  # a frozen parameter is never reduced (nor updated: it has no gradient)
                self.by_width.setdefault(width_of[n], []).append(p)
        self.groups = prefix_groups(self.widths, world.timeout_s) if world.backend != "none" else {}
        # a rank beyond every block's width holds nothing (a plan may leave it idle the whole step)
        self.opt = leaf_optimizer(None, self.named, optim, self.device) if self.named else None
        world.all_reduce(torch.zeros(1, device=self.device), "replica", "the start-up all-reduce")

    # ---- moving a boundary activation (and its gradient) between widths ---------------------------------------
    def _wait(self, work, what: str) -> None:
        self.world.wait(work, what)

    def _send_all(self, pieces: list[tuple[int, torch.Tensor]]) -> list:
        """Start sending each (destination, tensor), each after a header with its dtype and shape (a receiver
        outside the sending block's width has not seen the tensor's shape); the (work, tensor) pairs keep the
        tensors alive until the sends are waited for."""
        works = []
        for dst, t in pieces:
            head = tensor_header(t)
            if head is None:
                raise StratumError(f"burst moves tensors of up to {HEADER_LEN - 2} dimensions in {WIRE_DTYPES}; a "
                                   f"block returned {t.dim()} dimensions of {t.dtype}")
            t = t.contiguous()
            works += [(dist.isend(head, dst, tag=1), head), (dist.isend(t, dst, tag=2), t)]
        return works

    def _recv(self, src: int) -> torch.Tensor:
        """The next tensor from ``src``, shaped as the header that precedes it says."""
        head = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(head, src, tag=1), f"a burst tensor header from rank {src}")
        shape, dtype = header_shape(head)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.irecv(buf, src, tag=2), f"a burst boundary tensor from rank {src}")
        return buf

    def _move(self, h: torch.Tensor | None, total: int, a: int, b: int) -> torch.Tensor | None:
        """This rank's share under width ``b`` of a tensor held in shares under width ``a`` (an activation in the
        forward, its gradient in the backward); None on a rank outside ``b``."""
        src, dst, r = spans(total, a), spans(total, b), self.rank
        moves = overlaps(src, dst)

        def piece(lo: int, hi: int) -> torch.Tensor:  # of this rank's share (it has one where it sends)
            assert h is not None
            return h[lo - src[r][0]:hi - src[r][0]]
        sent = self._send_all([(d, piece(lo, hi)) for s, d, lo, hi in moves if s == r and d != r])
        got = None
        if r < b:  # the pieces arrive in sample order, the ones this rank already holds copied locally
            parts = [piece(lo, hi) if s == r else self._recv(s) for s, d, lo, hi in moves if d == r]
            got = torch.cat(parts) if len(parts) > 1 else parts[0]
        for work, _ in sent:
            self._wait(work, "sending a burst boundary tensor")
        return got

    # ---- one micro-batch ---------------------------------------------------------------------------------------
    def _micro(self, b: Batch, divisor: int) -> torch.Tensor:
        """Forward and backward of one micro-batch on this rank's shares; its weighted loss share (float64)."""
        total, r, w, L = b.x.shape[0], self.rank, self.widths, len(self.widths)
        if total < max(w):
            raise StratumError(f"a micro-batch of {total} samples cannot be split over {max(w)} burst processes")
        first = spans(total, w[0])
        h = b.x[first[r][0]:first[r][1]].to(self.device) if r < w[0] else None
        ins: list[torch.Tensor | None] = []
        outs: list[torch.Tensor | None] = []
        for i, blk in enumerate(self.model.blocks):
            if i > 0 and w[i] != w[i - 1]:
                h = self._move(h, total, w[i - 1], w[i])
            if r < w[i]:
                assert h is not None  # (this rank holds a share of block i's input)
                inp = h.detach().requires_grad_(h.is_floating_point())
                with block_stream(b.stream, i, self.device), autocast(self.device, self.precision):
                    out = blk(inp)
                ins.append(inp)
                outs.append(out)
                h = out.detach()
            else:
                ins.append(None)
                outs.append(None)
                h = None
        share = torch.zeros((), dtype=torch.float64, device=self.device)
        if r < w[-1]:
            lo, hi = spans(total, w[-1])[r]
            last = outs[-1]
            assert last is not None
            with autocast(self.device, self.precision):
                loss = self.model.loss_fn(last, b.y[lo:hi].to(self.device)) * ((hi - lo) / total)
            (loss / divisor).backward()
            share = loss.detach().double()
        for i in range(L - 1, 0, -1):
            g, x_in, prev = None, ins[i], outs[i - 1]
            if r < w[i]:
                assert x_in is not None
                g = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
            if w[i] != w[i - 1]:
                g = self._move(g, total, w[i], w[i - 1])
            if r < w[i - 1] and prev is not None and prev.requires_grad:  # (r < w[i - 1]: it has block i-1's)
                torch.autograd.backward(prev, g)
        return share

    # ---- GradEngine ------------------------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[Batch], divisor: int) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for b in micro_batches:
            loss += self._micro(b, divisor)
        self._reduce_grads()
        return self.world.all_reduce(loss, "replica", "the burst loss all-reduce")

    def _reduce_grads(self) -> None:
        """Sum each parameter's gradient over its reduction group (one flat all-reduce per width); a parameter
        no rank of its group had a gradient for ends without one (:mod:`stratum.parallel.presence`)."""
        for k, params in sorted(self.by_width.items()):
            if k < 2:
                continue
            flat, missing = presence.pack(params)
            self._wait(dist.all_reduce(flat, group=self.groups[k], async_op=True),
                       f"the gradient all-reduce over the first {k} ranks")
            presence.unpack(params, flat, missing)

    def grad_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.named

    def norm_counted(self) -> set[str]:
        return {n for n, _ in self.named} if self.rank == 0 else set()  # rank 0 holds every gradient

    def reduce_norm(self, norms: torch.Tensor) -> torch.Tensor:
        mine = torch.linalg.vector_norm(norms) if self.rank == 0 else torch.zeros(())
        return self.world.all_reduce(mine.to(self.device, torch.float32), "replica", "the gradient-norm all-reduce")

    def update(self, lr: float, coef: torch.Tensor) -> None:
        if self.opt is not None:
            self.opt.step(lr, coef)

    # ---- Engine ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        """Rank 0 (which holds every block) evaluates the whole batches, as the plain engine does."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.rank == 0:
            with evaluating([self.model]), autocast(self.device, self.precision):
                total += sum(float(self.model.loss(b.x.to(self.device), b.y.to(self.device))) for b in batches)
        return float(self.world.all_reduce(total, "replica", "the burst eval-loss all-reduce")) / len(batches)

    def state(self) -> TrainState:
        if self.rank != 0:
            return TrainState(params={}, optim={})
        return TrainState(params={n: full_tensor(p) for n, p in self.named},
                          optim=self.opt.export() if self.opt is not None else {},
                          buffers=buffers_to_cpu(self.model, self.held))

    def load_state(self, state: TrainState) -> None:
        load_params(self.named, state)
        if self.opt is not None:
            self.opt.load(state.optim)
        load_buffers(self.model, state.buffers)

    def describe(self) -> str:
        return self.plan.table() if self.plan is not None else f"burst widths {':'.join(map(str, self.widths))}"

    @property
    def predicted_step_s(self) -> float | None:
        return self.plan.step_for(self.microbatches) if self.plan is not None else None

    def memory_stats(self) -> dict[str, int]:
        return {"peak_device_bytes": peak_memory_bytes(self.device),
                "optim_state_bytes": self.opt.state_bytes() if self.opt is not None else 0}
