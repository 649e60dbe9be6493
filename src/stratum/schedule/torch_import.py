"""torch.distributed.pipelining's schedules in Stratum's Schedule IR (kinds ``torch:NAME``).

``NAME`` is a schedule class of ``torch.distributed.pipelining`` without its ``Schedule`` prefix (``GPipe``,
``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``; any
class torch adds under that name works the same way). The class is built once for P ranks on planning stand-ins
(the stage fields a schedule class reads while it plans: index, count, group size and rank), and its public
per-rank action list ``pipeline_order`` is converted:

- ``None`` (a deliberate idle step) is dropped: Stratum's executor waits for inputs instead;
- compute actions map one to one (``F``, ``B``, ``I``, ``W``); an ``OVERLAP_F_B`` is its sub-actions in order;
- other actions (``REDUCE_GRAD``, ``UNSHARD``, send / receive) are dropped: the engine does its own messages and
  gradient reductions.

The stage -> rank map is read off the action lists (the rank that runs a stage's actions owns it), and the
result is validated like any schedule. torch.distributed.pipelining takes seconds to import, so this module
is loaded only when a ``torch:`` kind is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from stratum.errors import StratumError
from stratum.schedule.ir import KINDS as ACTION_KINDS
from stratum.schedule.ir import Action, Schedule
from stratum.schedule.validate import validate

TORCH_NAMES = tuple(n[len("Schedule"):] for n in pipelining.__all__ if n.startswith("Schedule"))
"""The schedule classes torch.distributed.pipelining exports, without the ``Schedule`` prefix."""


@dataclass
class _PlanningStage:
    """What a torch schedule class reads from its stages while it plans (no module, no process group)."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: None = None
    stage_index_to_group_rank: dict[int, int] = field(default_factory=dict)


def torch_class(name: str) -> type:
    """The torch schedule class for ``name`` (case-insensitive, with or without the ``Schedule`` prefix)."""
    bare = name[len("Schedule"):] if name.lower().startswith("schedule") else name
    for known in TORCH_NAMES:
        if known.lower() == bare.lower():
            return getattr(pipelining, "Schedule" + known)
    raise StratumError(f"torch.distributed.pipelining has no schedule {name!r}; choose one of "
                       + ", ".join(f"torch:{n}" for n in TORCH_NAMES))


def _planned_order(cls: type, ranks: int, microbatches: int, virtual: int) -> dict:
    """``pipeline_order`` of ``cls`` built on planning stand-ins for ``ranks`` ranks."""
    make: Any = cls  # given duck-typed stand-ins (_PlanningStage), which torch's annotations refuse
    if issubclass(cls, PipelineScheduleSingle):
        sched = make(_PlanningStage(0, ranks, ranks), microbatches)
    else:
        n = ranks * virtual
        sched = make([_PlanningStage(s, n, ranks) for s in range(0, n, ranks)], microbatches)
    return sched.pipeline_order


def _compute_actions(items: list) -> list[Action]:
    """Stratum actions of one rank's torch action list (see the module docstring)."""
    out: list[Action] = []
    for a in items:
        if a is None:
            continue
        if a.sub_actions:
            out.extend(_compute_actions(list(a.sub_actions)))
            continue
        kind = a.computation_type.value
        if kind in ACTION_KINDS:
            out.append(Action(kind, a.stage_index, a.microbatch_index))
    return out


def _stage_owners(name: str, actions: list[list[Action]]) -> tuple[int, ...]:
    """Stage -> rank map read off the action lists; each stage must run on exactly one rank."""
    owner: dict[int, int] = {}
    for r, acts in enumerate(actions):
        for a in acts:
            if owner.setdefault(a.stage, r) != r:
                raise StratumError(f"{name}: stage {a.stage} has actions on ranks {owner[a.stage]} and {r}; "
                                   "a Stratum schedule places every stage on one rank")
    missing = [s for s in range(max(owner, default=-1) + 1) if s not in owner]
    if not owner or missing:
        raise StratumError(f"{name}: stages {missing or [0]} have no actions; torch planned an empty schedule")
    return tuple(owner[s] for s in range(len(owner)))


def from_torch(name: str, *, ranks: int, microbatches: int, virtual: int = 2) -> Schedule:
    """torch's schedule class ``name`` (see :func:`torch_class`) for ``ranks`` ranks and ``microbatches``
    micro-batches, as a validated :class:`Schedule`; ``virtual`` is the stages per rank of the multi-stage
    classes (ZBVZeroBubble and DualPipeV need 2). torch's refusals become one-line StratumErrors."""
    cls = torch_class(name)
    label = "torch:" + cls.__name__[len("Schedule"):]
    try:
        order = _planned_order(cls, ranks, microbatches, virtual)
    except (ValueError, RuntimeError, AssertionError, ZeroDivisionError, AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StratumError(f"{label} with {ranks} ranks, {microbatches} micro-batches and {virtual} stages per "
                           f"rank: torch refuses it ({' '.join(first.split())}); change the ranks, "
                           "micro-batches or stages per rank (pipeline.virtual, --virtual)") from None
    actions = [_compute_actions(list(order.get(r) or [])) for r in range(ranks)]
    sched = Schedule(name=label, stage_to_rank=_stage_owners(label, actions), num_microbatches=microbatches,
                     actions=actions)
    try:
        validate(sched)
    except StratumError as e:
        raise StratumError(f"{label}: torch's pipeline_order is not a valid schedule at {ranks} ranks and "
                           f"{microbatches} micro-batches ({e}); use another torch class or a Stratum kind") from None
    return sched
