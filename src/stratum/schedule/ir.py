"""The Schedule IR: which rank runs which pipeline action, in which order.

A pipeline of ``num_stages`` stages is spread over ``num_ranks`` ranks by ``stage_to_rank`` (index = stage).
Every rank runs its own ordered list of :class:`Action`:

- ``F(s, mb)`` forward of stage ``s`` on micro-batch ``mb``;
- ``B(s, mb)`` full backward (input and weight gradients);
- ``I(s, mb)`` input-gradient half of a split backward; ``W(s, mb)`` its weight-gradient half.

A (stage, micro-batch) pair uses either ``B`` or the ``I``/``W`` split, never both. The data dependencies are:

- ``F(s, mb)`` needs ``F(s-1, mb)`` (the stage's input activation);
- ``B/I(s, mb)`` needs ``F(s, mb)`` (saved activations) and ``B/I(s+1, mb)`` (the output gradient); the last
  stage's backward needs only its own forward (the loss is computed there);
- ``W(s, mb)`` needs ``I(s, mb)``.

Notation used everywhere (table, text files, messages): ``F3.1`` is the forward of stage 3 on micro-batch 1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from stratum.errors import StratumError

KINDS = ("F", "B", "I", "W")
"""Action kinds: forward, full backward, input-gradient backward, weight-gradient backward."""

_ACTION_RE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` of stage ``stage`` on micro-batch ``mb``."""

    kind: str
    stage: int
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StratumError(f"action kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.stage < 0 or self.mb < 0:
            raise StratumError(f"action {self.kind}{self.stage}.{self.mb}: stage and micro-batch must be >= 0")

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``F3.1`` style notation."""
        mt = _ACTION_RE.match(text.strip())
        if not mt:
            raise StratumError(
                f"cannot read action {text!r}: expected KIND STAGE.MB with KIND in F/B/I/W, e.g. F3.1"
            )
        return cls(mt.group(1), int(mt.group(2)), int(mt.group(3)))


def F(stage: int, mb: int) -> Action:  # noqa: N802 - mirrors the notation
    return Action("F", stage, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802
    return Action("B", stage, mb)


def I(stage: int, mb: int) -> Action:  # noqa: N802, E743
    return Action("I", stage, mb)


def W(stage: int, mb: int) -> Action:  # noqa: N802
    return Action("W", stage, mb)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """A complete pipeline schedule for one training step (``num_microbatches`` micro-batches).

    ``actions[r]`` is the ordered action list of rank ``r``. Construction only checks the shape; call
    :func:`stratum.schedule.validate.validate` for completeness, dependencies and deadlock freedom.
    """

    name: str
    stage_to_rank: Sequence[int]
    num_microbatches: int
    actions: Sequence[Sequence[Action]]

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples, so a Schedule is hashable and truly frozen.
        object.__setattr__(self, "stage_to_rank", tuple(int(r) for r in self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if not self.stage_to_rank:
            raise StratumError("a schedule needs at least one stage")
        if not self.actions:
            raise StratumError("a schedule needs at least one rank")
        if self.num_microbatches < 1:
            raise StratumError(f"a schedule needs at least one micro-batch, got {self.num_microbatches}")
        for s, r in enumerate(self.stage_to_rank):
            if not 0 <= r < self.num_ranks:
                raise StratumError(
                    f"stage {s} is mapped to rank {r}, but the schedule has ranks 0..{self.num_ranks - 1}"
                )
        if not re.fullmatch(r"[A-Za-z0-9_.+:-]+", self.name):
            raise StratumError(f"schedule name {self.name!r} must be one word of letters, digits, _ . + - :")

    # ---- shape --------------------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        """Stages held by ``rank``, ascending."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def all_actions(self) -> list[tuple[int, Action]]:
        """Every ``(rank, action)`` in rank-major order."""
        return [(r, a) for r, acts in enumerate(self.actions) for a in acts]

    # ---- dependencies -------------------------------------------------------------------------------------
    def grad_action(self, stage: int, mb: int) -> Action:
        """The action producing the input gradient of ``(stage, mb)``: ``I`` if the pair is split, else ``B``."""
        return Action("I", stage, mb) if Action("I", stage, mb) in self._action_set() else Action("B", stage, mb)

    def _action_set(self) -> frozenset[Action]:
        # Cached on the instance: frozen dataclasses still allow object.__setattr__ for private caches.
        cache = self.__dict__.get("_aset")
        if cache is None:
            cache = frozenset(a for acts in self.actions for a in acts)
            object.__setattr__(self, "_aset", cache)
        return cache

    def deps(self, action: Action) -> list[Action]:
        """Actions whose results ``action`` consumes (see the module docstring for the rules)."""
        s, mb = action.stage, action.mb
        if action.kind == "F":
            return [Action("F", s - 1, mb)] if s > 0 else []
        if action.kind in "BI":
            out = [Action("F", s, mb)]
            if s + 1 < self.num_stages:
                out.append(self.grad_action(s + 1, mb))
            return out
        return [Action("I", s, mb)]  # W

    # ---- display ------------------------------------------------------------------------------------------
    def unit_slots(self) -> list[list[int]]:
        """Time slot of every action when each action takes one slot and messages are free.

        ``slots[r][k]`` is the slot of ``actions[r][k]``: the earliest slot after the previous action of the
        rank and after all its dependencies. Raises :class:`StratumError` if the schedule cannot run.
        """
        done: dict[Action, int] = {}
        ptr = [0] * self.num_ranks
        free = [0] * self.num_ranks
        slots: list[list[int]] = [[] for _ in range(self.num_ranks)]
        total = sum(len(a) for a in self.actions)
        while len(done) < total:
            progressed = False
            for r in range(self.num_ranks):
                while ptr[r] < len(self.actions[r]):
                    a = self.actions[r][ptr[r]]
                    ds = self.deps(a)
                    if any(d not in done for d in ds):
                        break
                    t = max([free[r]] + [done[d] + 1 for d in ds])
                    done[a] = t
                    slots[r].append(t)
                    free[r] = t + 1
                    ptr[r] += 1
                    progressed = True
            if not progressed:
                raise StratumError(
                    f"schedule {self.name} cannot run to the end (missing action or deadlock); "
                    "run validate() for the reason"
                )
        return slots

    def table(self) -> str:
        """Rank x time-slot table, one row per rank, one column per unit time slot, ``.`` for idle.

        Each action takes one slot (whatever its real cost), so the table shows the order and the waits
        imposed by the dependencies, like torchgpipe's clock cycles.
        """
        slots = self.unit_slots()
        width = max([1] + [len(str(a)) for acts in self.actions for a in acts])
        n_slots = max([0] + [s[-1] + 1 for s in slots if s])
        rows = []
        for r in range(self.num_ranks):
            cells = ["."] * n_slots
            for a, t in zip(self.actions[r], slots[r]):
                cells[t] = str(a)
            rows.append(f"rank {r}: " + " ".join(c.ljust(width) for c in cells).rstrip())
        return "\n".join(rows)

    def describe(self) -> str:
        """One-line summary of the schedule's shape."""
        return (
            f"{self.name}: {self.num_stages} stages on {self.num_ranks} ranks, {self.num_microbatches} "
            f"micro-batches, stage->rank {list(self.stage_to_rank)}"
        )
