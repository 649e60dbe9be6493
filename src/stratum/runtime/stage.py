"""The per-rank pipeline runtime: execute this rank's action list of a :class:`~stratum.schedule.ir.Schedule`.

For each action in order the runtime takes the inputs the schedule's :func:`~stratum.schedule.validate.comm_plan`
says it receives (a local hand-off when the producing stage is on this rank, else a point-to-point message),
runs it, and hands on what it produces:

- ``F(s, mb)``: the stage's blocks on the input (token ids for stage 0, else a received activation made a leaf
  that requires grad); the last stage also computes ``loss_fn(out, y) / m`` for the backward.
- ``B(s, mb)``: ``autograd.backward`` from the stage output with the received output gradient (the scaled loss
  on the last stage): weight gradients accumulate into ``.grad``, the input gradient goes to stage ``s-1``.
- ``I(s, mb)``: input gradient only; ``W(s, mb)``: weight gradients only, accumulated into ``.grad``. I + W
  give B's gradients and, together, do B's work once (zero-bubble split): I finds the autograd nodes where the
  parameters' gradient paths leave the input-gradient path ("intermediates"), runs ``autograd.grad`` w.r.t. the
  stage input only (graph retained) and keeps, through node pre-hooks, the gradients that flowed into those
  nodes; W then runs ``autograd.grad`` from the intermediates to the parameters, which touches only the
  weight-gradient branches (see :func:`_backward_input` / :func:`_backward_weight`). Stage 0 (no input gradient)
  does nothing at I and the whole backward at W.

Messages: every remote receive is posted ahead (the next ``lookahead`` actions' receives go out in the same
``batch_isend_irecv`` as the current action's sends), so transfers overlap compute; gloo runs them on its own
threads, NCCL on its stream. Messages carry a tag unique within a step (kind, boundary, micro-batch), so they
pair up whatever order the ranks post them in. Shapes: before the first step with a new input shape, one
forward pass of a single micro-batch (no grad, under ``neutral``: RNG and buffers untouched) sends each
boundary's shape and dtype to the next rank, so every later receive is pre-allocated. Every wait has a deadline
(``timeout_s``); a peer that died or hung becomes a :class:`~stratum.errors.PeerError` naming the rank and
the message.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from stratum.data.tokens import Batch
from stratum.dist.launch import short_reason, wait_until
from stratum.errors import PeerError
from stratum.model.neutral import neutral
from stratum.model.streams import block_stream
from stratum.runtime.device import autocast
from stratum.runtime.tensors import HEADER_LEN, header_shape, tensor_header
from stratum.schedule.ir import Action, Schedule
from stratum.schedule.validate import ActionComm, Transfer, comm_plan

_HDR_TAG = 1 << 30
FAULT_ENV = "STRATUM_TEST_FAULT"
"""Test hook: ``RANK:STEP:ACTION`` makes that rank SIGKILL itself before that action (index in its list) of that
(0-based) training step; ``RANK:STEP:ACTION:stop`` makes it SIGSTOP itself (a hung rank). The time of the fault
is written to the file ``$STRATUM_TEST_FAULT_FILE`` names, if set."""


@dataclass
class _Saved:
    inp: Tensor | None
    out: Tensor | None
    grad_out: Tensor | None = None
    groups: list[_WeightGroup] | None = None
    """Set by a split ``I``: what ``W`` needs (then ``out`` and ``grad_out`` are dropped)."""


# ---- split backward (I / W) ----------------------------------------------------------------------------------
# The same scheme as torch.distributed.pipelining's stage_backward_input / stage_backward_weight (private module
# torch/distributed/pipelining/_backward.py), written out here rather than called because those functions do not
# fit this runtime cleanly: they detach the stage output in place (a RuntimeError when a block returns a view),
# they silently give no weight gradients when the output does not depend on the input (nothing intersects the
# input path), their W calls autograd.grad without allow_unused, they accumulate into the input's .grad as a side
# effect, and being private they may change between torch releases. What is kept from them: the grouping of
# parameters by shared intermediates and the "pin each intermediate to its I gradient" pre-hook of a group with
# several intermediates, so nothing is counted twice.

@dataclass
class _WeightGroup:
    """Parameters (indices into the stage's parameter list) whose gradient paths leave the input-gradient path
    at ``nodes``; ``grads[k]`` is what flowed into ``nodes[k]`` during I (its ``grad_outputs``)."""

    params: list[int]
    nodes: list[Node]
    grads: list[tuple | None]


def _split_graph(root: Node, inp_node: Node, param_index: dict[Node, int]) -> list[_WeightGroup] | None:
    """Group the parameters below ``root`` by the input-path nodes their gradients branch off from.

    A node is on the input path when the stage input's gradient accumulator is reachable from it. An
    intermediate is an input-path node with an edge to a node off the path that reaches a parameter; everything
    below such an edge is off the path (weight-gradient work only). Intermediates that reach a common parameter
    share a group, so one ``autograd.grad`` per group gets each parameter's whole gradient. None when ``root``
    is not on the input path (the output does not depend on the input): then no intermediate covers the
    parameters and W must walk from the output.
    """
    on_path: dict[Node, bool] = {}
    below: dict[Node, frozenset[int]] = {}  # parameters reachable from a node off the input path
    inter: list[tuple[Node, frozenset[int]]] = []
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # iterative post-order walk (graphs are deep: no recursion)
        node, expanded = stack.pop()
        if node in on_path:
            continue
        if node is inp_node:  # the input is a leaf here; nothing below it belongs to this stage
            on_path[node] = True
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in kids if c not in on_path)
            continue
        if any(on_path[c] for c in kids):
            on_path[node] = True
            ps = frozenset().union(*(below[c] for c in kids if not on_path[c]))
            if ps:
                inter.append((node, ps))
        else:
            on_path[node] = False
            i = param_index.get(node)
            below[node] = frozenset().union(*(below[c] for c in kids), () if i is None else (i,))
    if not on_path.get(root):
        return None
    owner: dict[int, _WeightGroup] = {}  # parameter -> its group (groups merge when they share a parameter)
    for node, ps in inter:
        g = _WeightGroup(params=sorted(ps), nodes=[node], grads=[])
        for h in {id(o): o for o in (owner.get(p) for p in ps) if o is not None}.values():
            g.params = sorted(set(g.params) | set(h.params))
            g.nodes = h.nodes + g.nodes
        for p in g.params:
            owner[p] = g
    groups = list({id(g): g for g in owner.values()}.values())
    for g in groups:
        g.grads = [None] * len(g.nodes)
    return groups


def _capture(grads: list, k: int):
    def hook(grad_outputs):  # references only the list, never a node: no hook -> node cycle to leak the graph
        grads[k] = grad_outputs
    return hook


def _backward_input(out: Tensor, grad_out: Tensor | None, inp: Tensor,
                    params: list[nn.Parameter]) -> tuple[Tensor | None, list[_WeightGroup] | None]:
    """The I half: gradient of ``out`` w.r.t. ``inp`` (a leaf), plus what W needs (None: W walks from ``out``).

    ``autograd.grad(..., inputs=[inp])`` executes only the input-path nodes and computes only their input-side
    gradients; the pre-hooks on the intermediates record the gradients reaching them on the way."""
    root = out.grad_fn
    groups = None
    if root is not None and params:
        param_index = {get_gradient_edge(p).node: i for i, p in enumerate(params)}
        groups = _split_graph(root, get_gradient_edge(inp).node, param_index)
    handles = []
    try:
        for g in groups or ():
            handles += [node.register_prehook(_capture(g.grads, k)) for k, node in enumerate(g.nodes)]
        (dinp,) = torch.autograd.grad(out, [inp], grad_out, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return dinp, groups


def _backward_weight(groups: list[_WeightGroup], params: list[nn.Parameter]) -> None:
    """The W half: from each group's intermediates (seeded with their I gradients) to its parameters; only the
    branches towards the parameters run. Gradients are accumulated into ``.grad``."""
    for g in groups:
        edges: list[GradientEdge] = []
        seeds: list[Tensor] = []
        for node, got in zip(g.nodes, g.grads):
            for i, t in enumerate(got or ()):
                if t is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(t)
        if not edges:
            continue
        handles = []
        try:
            if len(g.nodes) > 1:
                # a parameter used at several depths: one intermediate's flow can reach another along the input
                # path; pin every intermediate to the gradient it had in I so nothing is counted twice
                for node, got in zip(g.nodes, g.grads):
                    handles.append(node.register_prehook(
                        lambda gin, got=got: got if got is not None else tuple(None for _ in gin)))
            ps = [params[i] for i in g.params]
            dws = torch.autograd.grad(edges, ps, seeds, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        _accumulate(ps, dws)


def _accumulate(params, grads) -> None:
    """Add ``grads`` into ``.grad`` the way autograd accumulates (``None``: the parameter got no gradient)."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def _tag(t: Transfer, num_stages: int) -> int:
    boundary = t.src_stage if t.tensor == "act" else t.dst_stage
    return ((t.mb * num_stages + boundary) * 2 + (t.tensor == "grad")) + 1


def _key(t: Transfer) -> tuple[str, int, int]:
    return (t.tensor, t.src_stage if t.tensor == "act" else t.dst_stage, t.mb)


class StageBlocks(Protocol):
    """How a rank runs its stages' blocks: the runtime decides when, this decides how (where the weights are)."""

    def forward(self, s: int, mb: int, x: Tensor, stream: int | None, training: bool) -> Tensor:
        """Stage ``s``'s blocks on ``x`` for micro-batch ``mb`` (autograd records when ``training``)."""

    def backward(self, s: int, mb: int, out: Tensor, grad: Tensor | None) -> None:
        """Back-propagate stage ``s``'s micro-batch ``mb`` from ``out`` (its output, or its scaled loss) with
        ``grad``: weight gradients accumulate, the input gets its ``.grad``."""


class LocalBlocks:
    """The stages' blocks as ordinary modules on the device: a forward is a call, a backward one autograd pass."""

    def __init__(self, blocks: dict[int, list[nn.Module]], block_ids: dict[int, list[int]], device: torch.device):
        self.blocks = blocks
        self.block_ids = block_ids
        self.device = device

    def forward(self, s: int, mb: int, x: Tensor, stream: int | None, training: bool) -> Tensor:
        for i, b in zip(self.block_ids[s], self.blocks[s]):
            with block_stream(stream, i, self.device):
                x = b(x)
        return x

    def backward(self, s: int, mb: int, out: Tensor, grad: Tensor | None) -> None:
        if out.requires_grad:
            torch.autograd.backward(out, grad)


class StageRuntime:
    """Runs one rank's share of pipeline steps: its stages' blocks, its actions, its messages."""

    def __init__(self, *, blocks: list[nn.Module], stages: list[range], stage_to_rank: Sequence[int],
                 loss_fn, rank: int, device: torch.device, precision: str, timeout_s: float, backend: str,
                 peers: tuple[int, ...] | None = None, lookahead: int = 2, runner: StageBlocks | None = None):
        self.rank = rank
        # pipeline rank -> process rank: each replica's (and split's) pipeline is one slice of the process mesh
        self.peers = tuple(peers) if peers is not None else tuple(range(max(stage_to_rank) + 1))
        self.device = device
        self.precision = precision
        self.timeout_s = timeout_s
        self.backend = backend
        self.lookahead = lookahead
        self.loss_fn = loss_fn
        self.stage_to_rank = tuple(stage_to_rank)
        self.S = len(stage_to_rank)
        self.my_stages = [s for s, r in enumerate(stage_to_rank) if r == rank]
        self.blocks = {s: [blocks[i] for i in stages[s]] for s in self.my_stages}
        self.block_ids = {s: list(stages[s]) for s in self.my_stages}
        self.runner: StageBlocks = runner or LocalBlocks(self.blocks, self.block_ids, device)
        self.stage_params: dict[int, list[nn.Parameter]] = {}
        for s in self.my_stages:
            seen: dict[int, nn.Parameter] = {}
            for b in self.blocks[s]:
                for p in b.parameters():
                    if p.requires_grad:
                        seen.setdefault(id(p), p)
            self.stage_params[s] = list(seen.values())
        self._shapes: dict[tuple, dict[int, tuple[torch.Size, torch.dtype]]] = {}
        self._plans: dict[Schedule, list[ActionComm]] = {}
        self.step_index = 0
        self.stats = {"compute_s": 0.0, "wait_s": 0.0}
        self._fault = self._parse_fault()

    # ---- helpers ------------------------------------------------------------------------------------------
    def _parse_fault(self):
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return None
        parts = spec.split(":")
        r, st, k = (int(v) for v in parts[:3])
        self._fault_signal = "SIGSTOP" if parts[3:] == ["stop"] else "SIGKILL"
        return (st, k) if r == self.peers[self.rank] else None  # r is a process rank

    def _wait(self, work, what: str, deadline: float) -> None:
        t0 = time.perf_counter()
        try:
            wait_until(work, backend=self.backend, deadline=deadline)
        except TimeoutError:
            raise PeerError(f"rank {self.peers[self.rank]}: no {what} within {self.timeout_s:g} s "
                            "(parallel.timeout_s); that rank died or hung — stopping") from None
        except RuntimeError as e:
            msg = short_reason(e)
            kind = "timed out" if "imed out" in msg else "lost its peer"
            raise PeerError(f"rank {self.peers[self.rank]}: {kind} waiting for {what} ({msg}); "
                            "a pipeline rank died or hung — stopping") from None
        finally:
            self.stats["wait_s"] += time.perf_counter() - t0

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def plan_of(self, sched: Schedule) -> list[ActionComm]:
        plan = self._plans.get(sched)
        if plan is None:
            plan = comm_plan(sched)[self.rank]
            self._plans[sched] = plan
        return plan

    # ---- shapes -------------------------------------------------------------------------------------------
    def _ensure_shapes(self, x: Tensor, training: bool) -> dict[int, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every stage boundary next to this rank for inputs shaped like ``x``."""
        key = (tuple(x.shape), x.dtype, training)
        got = self._shapes.get(key)
        if got is not None:
            return got
        shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
        where = self.stage_to_rank
        mine = [b for s in self.my_stages for b in self.blocks[s]]
        # a training step's probe runs in training mode, which moves running statistics: neutral puts them back
        with torch.no_grad(), neutral(*mine, devices=[self.device]):
            for s in self.my_stages:
                if s == 0:
                    inp = x.to(self.device)
                else:
                    if where[s - 1] != self.rank:
                        hdr = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
                        w = dist.irecv(hdr, self.peers[where[s - 1]], tag=_HDR_TAG + s - 1)
                        self._wait(w, f"the shape of stage {s - 1}'s output from rank {self.peers[where[s - 1]]}",
                                   self._deadline())
                        shapes[s - 1] = header_shape(hdr)
                    shp, dt = shapes[s - 1]
                    inp = torch.zeros(shp, dtype=dt, device=self.device)
                if s == self.S - 1:
                    continue
                with autocast(self.device, self.precision):
                    out = self.runner.forward(s, -1, inp, None, False)
                shapes[s] = (out.shape, out.dtype)
                if where[s + 1] != self.rank:
                    head = tensor_header(out)
                    if head is None:
                        raise PeerError(f"stage {s} outputs a {out.dim()}-d {out.dtype} tensor; the pipeline "
                                        "carries up to 8-d tensors of common dtypes")
                    w = dist.isend(head, self.peers[where[s + 1]], tag=_HDR_TAG + s)
                    self._wait(w, f"rank {self.peers[where[s + 1]]} to take the shape of stage {s}'s output",
                               self._deadline())
        self._shapes[key] = shapes
        return shapes

    # ---- one step -----------------------------------------------------------------------------------------
    def run(self, sched: Schedule, batches: list[Batch], *, training: bool, scale: float) -> Tensor:
        """Run this rank's actions of ``sched`` over ``batches``; the summed (unscaled) loss of the micro-batches
        whose last stage is here (zero elsewhere), as a float64 tensor on the device."""
        plan = self.plan_of(sched)
        shapes = self._ensure_shapes(batches[0].x, training)
        shapes_of = {mb: self._ensure_shapes(b.x, training) for mb, b in enumerate(batches)} \
            if len({tuple(b.x.shape) for b in batches}) > 1 else None

        def boundary(t: Transfer) -> tuple[torch.Size, torch.dtype]:
            return (shapes_of[t.mb] if shapes_of else shapes)[t.src_stage if t.tensor == "act" else t.dst_stage]
        # summed as the plain engine sums them, so that the step's loss is its to the bit: a training step's
        # micro-batch losses in fp32, an evaluation's in double
        loss_sum = torch.zeros((), dtype=torch.float32 if training else torch.float64, device=self.device)
        saved: dict[tuple[int, int], _Saved] = {}
        box = _Mailbox(self, plan, boundary)
        box.post_receives(1 + self.lookahead)
        for k, ac in enumerate(plan):
            if self._fault is not None and self._fault == (self.step_index, k):
                self._inject_fault()
            inputs = [box.take(t) for t in ac.recv]
            t0 = time.perf_counter()
            out_msgs = self._execute(ac.action, inputs, batches, saved, training=training, scale=scale,
                                     loss_sum=loss_sum)
            self.stats["compute_s"] += time.perf_counter() - t0
            # this action's sends and the receives of the actions ahead go out in one batch
            box.send(ac.send, out_msgs, post_upto=k + 2 + self.lookahead)
        box.finish_sends()
        if box.posted or box.local or saved:  # a valid schedule consumes everything it produces
            raise RuntimeError(f"rank {self.peers[self.rank]}: schedule {sched.name} left work behind: "
                               f"{sorted(box.posted)[:3]} {sorted(box.local)[:3]} {sorted(saved)[:3]}")
        if training:
            self.step_index += 1
        return loss_sum

    def _inject_fault(self) -> None:
        """The FAULT_ENV test hook: this process kills or stops itself here."""
        if os.environ.get(FAULT_ENV + "_FILE"):  # when it happened, for the test's stopwatch
            with open(os.environ[FAULT_ENV + "_FILE"], "w") as fh:
                fh.write(repr(time.time()))
        os.kill(os.getpid(), getattr(signal, self._fault_signal))

    def _execute(self, a: Action, inputs: list[Tensor], batches: list[Batch], saved: dict, *, training: bool,
                 scale: float, loss_sum: Tensor) -> list[Tensor]:
        s, mb, last = a.stage, a.mb, a.stage == self.S - 1
        if a.kind == "F":
            if s == 0:
                inp = batches[mb].x.to(self.device, non_blocking=True)
            else:
                inp = inputs[0]
                if training and inp.is_floating_point():
                    inp = inp.detach().requires_grad_(True)
            with torch.set_grad_enabled(training), autocast(self.device, self.precision):
                out = self.runner.forward(s, mb, inp, batches[mb].stream if training else None, training)
                if last:
                    y = batches[mb].y.to(self.device, non_blocking=True)
                    loss = self.loss_fn(out, y)
            if last:
                loss_sum += loss.detach().to(loss_sum.dtype)
                if training:
                    saved[(s, mb)] = _Saved(inp=inp if s > 0 else None, out=loss * scale)
                return []
            if training:
                saved[(s, mb)] = _Saved(inp=inp if s > 0 else None, out=out)
            return [out.detach()]
        if a.kind == "B":
            sv = saved.pop((s, mb))
            self.runner.backward(s, mb, sv.out, None if last else inputs[0])
            return [self._input_grad(sv)] if s > 0 else []
        if a.kind == "I":
            sv = saved[(s, mb)]
            sv.grad_out = None if last else inputs[0]
            if s == 0:
                return []
            if sv.inp is not None and sv.inp.requires_grad and sv.out.requires_grad:
                g, sv.groups = _backward_input(sv.out, sv.grad_out, sv.inp, self.stage_params[s])
                if sv.groups is not None:  # W starts from the intermediates: the graph above them can go
                    sv.out = sv.grad_out = None
            else:
                g = None
            return [g if g is not None else torch.zeros_like(sv.inp)]
        if a.kind == "W":
            sv = saved.pop((s, mb))
            params = self.stage_params[s]
            if sv.groups is not None:
                _backward_weight(sv.groups, params)
            elif params and sv.out.requires_grad:  # stage 0, or an output that does not depend on the input
                _accumulate(params, torch.autograd.grad(sv.out, params, sv.grad_out, allow_unused=True))
            return []
        raise AssertionError(a)

    @staticmethod
    def _input_grad(sv: _Saved) -> Tensor:
        assert sv.inp is not None  # (a stage that sends a gradient back took an input that wants one)
        g = sv.inp.grad
        return g if g is not None else torch.zeros_like(sv.inp)


class _Mailbox:
    """One step's messages on one rank: receives posted ahead of the actions that take them (pre-allocated at
    their boundary's shape), local hand-offs between this rank's stages, and sends kept referenced until they
    complete."""

    def __init__(self, rt: StageRuntime, plan: list[ActionComm],
                 boundary: Callable[[Transfer], tuple[torch.Size, torch.dtype]]):
        self.rt, self.plan, self.boundary = rt, plan, boundary
        self.local: dict[tuple[str, int, int], Tensor] = {}
        self.posted: dict[tuple[str, int, int], tuple[object, Tensor, Transfer]] = {}
        self.sends: list[tuple[dist.Work, Tensor, Transfer]] = []
        self.next_post = 0  # index of the first action whose receives are not posted yet

    def _recv_ops(self, upto: int) -> list:
        rt, ops = self.rt, []
        while self.next_post < min(upto, len(self.plan)):
            for t in self.plan[self.next_post].recv:
                if t.local:
                    continue
                shp, dt = self.boundary(t)
                buf = torch.empty(shp, dtype=dt, device=rt.device)
                ops.append((dist.P2POp(dist.irecv, buf, rt.peers[t.src_rank], tag=_tag(t, rt.S)), buf, t, True))
            self.next_post += 1
        return ops

    def _launch(self, ops: list) -> None:
        if not ops:
            return
        works = dist.batch_isend_irecv([o for o, _, _, _ in ops])
        for w, (_, buf, t, is_recv) in zip(works, ops):
            if is_recv:
                self.posted[_key(t)] = (w, buf, t)
            else:
                self.sends.append((w, buf, t))  # the tensor stays referenced until its send completes

    def post_receives(self, upto: int) -> None:
        """Post the receives of the actions before index ``upto``."""
        self._launch(self._recv_ops(upto))

    def take(self, t: Transfer) -> Tensor:
        """The tensor ``t`` delivers, once it has arrived."""
        if t.local:
            return self.local.pop(_key(t))
        if _key(t) not in self.posted:
            self.post_receives(len(self.plan))  # not reached with a lookahead >= 0; kept for safety
        w, buf, _ = self.posted.pop(_key(t))
        name = "activation" if t.tensor == "act" else "gradient"
        self.rt._wait(w, f"the {name} of stage {t.src_stage} micro-batch {t.mb} from rank {self.rt.peers[t.src_rank]}",
                      self.rt._deadline())
        return buf

    def send(self, transfers: Sequence[Transfer], tensors: Sequence[Tensor], *, post_upto: int) -> None:
        """Hand on an action's outputs, in one batch with the receives of the actions before ``post_upto``."""
        rt, ops = self.rt, []
        for t, tensor in zip(transfers, tensors):
            if t.local:
                self.local[_key(t)] = tensor
            else:
                tensor = tensor.contiguous()
                ops.append((dist.P2POp(dist.isend, tensor, rt.peers[t.dst_rank], tag=_tag(t, rt.S)), tensor, t,
                            False))
        self._launch(ops + self._recv_ops(post_upto))
        if len(self.sends) > 8:  # drop finished sends, so their tensors can be freed before the step ends
            self.sends[:] = [x for x in self.sends if not x[0].is_completed()]

    def finish_sends(self) -> None:
        """Wait for every send of the step to be taken."""
        for w, _, t in self.sends:
            name = "activation" if t.tensor == "act" else "gradient"
            self.rt._wait(w, f"rank {self.rt.peers[t.dst_rank]} to take the {name} of stage {t.src_stage} "
                               f"micro-batch {t.mb}",
                          self.rt._deadline())
