"""The offload engine gives its device slots back between shard tasks (a multi-job scheduler's waits, so that the
jobs sharing a device hold only the running tasks' memory): vacated at every block boundary of every step, the run
is the same run bit for bit — every chunk written home first, fetched again at the next access; the in-flight
micro-batch's tensors (block inputs and outputs, the gradients between two blocks' backwards, what kept blocks'
graphs saved) moved to host memory and back — and while vacated the device holds only buffers: the pinned (tied)
chunk is copied out and back too, and no graph holds an activation there."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from stratum.model.gpt import build_gpt
from stratum.offload.engine import OffloadEngine
from stratum.offload.tasks import Turn, set_gate
from stratum.offload.tiers import DEVICE, DISK, HOST
from stratum.runtime.loss_scale import LossScaleSpec

from offload_helpers import DEV, assert_same, plain, plan, profile, run, spec, state_bytes


def _model():
    return build_gpt("tiny", vocab_size=256, seed=0)


@dataclass(frozen=True)
class Recipe:
    """One engine set-up of GPT tiny: ``streams`` at half its state (3 slots), else every chunk on the device."""

    optimizer_tier: str
    clip: float
    activations: str
    precision: str = "fp32"
    streams: bool = True
    handoff: str = "auto"
    delayed: bool = False

    def engine(self) -> OffloadEngine:
        m = _model()
        S = state_bytes(m)
        budget = dict(device_budget=S // 2, resident_chunks=3) if self.streams else {}
        p = plan(m, profile(m, self.precision), clip=self.clip, chunk_elems=29_120, optimizer_tier=self.optimizer_tier,
                 activations=self.activations, prefetch_depth=2, precision=self.precision, grad_handoff=self.handoff,
                 host_budget=None if self.optimizer_tier != DISK else S // 3, **budget)
        assert (p.param_tier != DEVICE) == self.streams
        assert self.handoff == "auto" or p.chunk_grads == (self.handoff == "chunk")  # (auto: chunk on a GPU)
        return OffloadEngine(m, optim=spec(self.clip), device=DEV, placement=p, precision=self.precision,
                             delayed_update=self.delayed, loss_scale=FORCED if self.precision == "fp16" else None)


FORCED = LossScaleSpec(init_scale=2.0**19, growth_interval=2)
"""fp16's first scales overflow, so steps are skipped and the scale backs off (vacated or not alike)."""


def _linear_inputs(model: torch.nn.Module) -> list[StorageWeakRef]:
    """Weak references to the storage of every Linear's input from now on (its graph saves it for the weight's
    gradient): expired once nothing holds it."""
    refs: list[StorageWeakRef] = []

    def note(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        refs.append(StorageWeakRef(args[0].untyped_storage()))

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(note)
    return refs


def _params(eng: OffloadEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.state().params.items()}


CASES = [Recipe(HOST, 1.0, "keep"), Recipe(HOST, 0.0, "recompute"), Recipe(DISK, 1.0, "recompute"),
         Recipe(HOST, 1.0, "recompute", "bf16"), Recipe(DISK, 0.0, "recompute", "bf16"),
         Recipe(HOST, 1.0, "keep", streams=False), Recipe(HOST, 0.0, "recompute", streams=False),
         Recipe(HOST, 0.0, "recompute", "bf16", handoff="chunk"), Recipe(HOST, 1.0, "keep", "bf16", delayed=True),
         Recipe(HOST, 1.0, "recompute", "fp16"), Recipe(HOST, 1.0, "offload"), Recipe(DISK, 0.0, "offload", "bf16")]


def _name(r: Recipe) -> str:
    words = {"streams": "all-pinned", "delayed": "delayed"}
    return "-".join(words.get(k, str(v)) for k, v in vars(r).items() if v != Recipe.__dataclass_fields__[k].default)


@pytest.mark.parametrize("recipe", CASES, ids=_name)
def test_vacating_at_every_boundary_is_the_same_run(recipe):
    ref = recipe.engine()
    try:
        want, want_params = run(ref, 4), _params(ref)
    finally:
        ref.close()
    eng = recipe.engine()
    assert (recipe.activations == "offload") == bool(eng.placement.spilled(len(eng.model)))
    slot_bytes = sum(s.numel() * s.element_size() for s in eng.slots)
    slot_bytes += sum(c.slot.numel() * c.slot.element_size() for c in eng.chunks if c.pinned and c.slot is not None)
    assert slot_bytes > 0 and any(c.pinned for c in eng.chunks)  # (GPT's tied embedding and head: pinned)
    seen: list[tuple[str, int, int, int, int, int]] = []
    saved = _linear_inputs(eng.model)  # (what the graphs save for each Linear's weight gradient)

    def gate(kind: str, block: int, blocks: int, turn: Turn) -> None:
        before, charged, act = turn.device_bytes(), eng.tiers[DEVICE].used, 0 if eng._vacated else eng._act
        freed = turn.vacate()
        seen.append((kind, freed, charged - eng.tiers[DEVICE].used, before, turn.device_bytes(), act))
        # left: buffers and, in a backward, the tied chunk's gradient of this micro-batch
        assert not eng.resident and eng.tiers[DEVICE].used >= held
        assert eng._mb is not None and eng._mb.away and eng._mb.away_bytes > 0  # (the carry at least)
        assert all(ref.expired() for ref in saved), "a graph still holds an activation on the device"
        if block % 2:
            turn.stage_next()  # (a waiting job next in line moves its next chunks: the slots come back)

    held = eng.tiers[DEVICE].used - slot_bytes
    set_gate(gate)
    try:
        got = run(eng, 4)
        got_params = _params(eng)
    finally:
        set_gate(None)
        eng.close()
    if DEV.type == "cpu":  # (a GPU's embedding backward adds with atomics: not bit-reproducible run to run)
        # (str: an fp16 step's skipped gradient norm is NaN, which equals nothing)
        assert [(r.loss, str(r.grad_norm), r.skipped) for r in got] == [
            (r.loss, str(r.grad_norm), r.skipped) for r in want]
        assert all(torch.equal(got_params[k], w) for k, w in want_params.items())
    else:
        assert_same([r.loss for r in got], [r.loss for r in want])
    assert recipe.precision != "fp16" or any(r.skipped for r in got)
    assert len(seen) // 2 < eng.n_vacates <= len(seen)  # (a boundary with nothing resident gives nothing back)
    # what the engine counts as held on the device afterwards: its charged buffers, no activation
    assert all(slots in (0, slot_bytes) and freed > slots and after == before - slots - act
               for _, freed, slots, before, after, act in seen)
    if recipe.precision == "fp32":
        assert_same([r.loss for r in got], [r.loss for r in run(plain(_model(), recipe.clip), 4)])


def test_vacate_with_the_optimizer_on_the_device_gives_nothing_back():
    """No budget: every chunk and its AdamW state on the device, which a vacate leaves there (a sweep places the
    optimizer on the host)."""
    m = _model()
    eng = OffloadEngine(m, optim=spec(), device=DEV, placement=plan(m, profile(m)))
    try:
        assert not eng.slots and eng.placement.optimizer_tier == DEVICE
        assert eng.vacate() == 0 and eng.n_vacates == 0
        assert_same([r.loss for r in run(eng, 2)], [r.loss for r in run(plain(_model()), 2)])
    finally:
        eng.close()
