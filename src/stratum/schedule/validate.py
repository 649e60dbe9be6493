"""Check a :class:`Schedule` before it runs, and derive the point-to-point messages it implies.

Execution semantics checked here (the executor's): each rank runs its list in order, and an action can start
once every input it consumes has been produced, by an earlier action of its own rank or by another rank's
action (sends are asynchronous, so a producer never waits for its consumer). A schedule passes when every
rank can run its whole list under these rules. Blocking rendezvous sends (a send completes only when the
receiver posts the receive) are stricter and are *not* what is checked.

:func:`comm_plan` lists, per rank and action, which tensors to receive before the action and send after it,
marking hand-offs between stages on the same rank as local.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from stratum.errors import StratumError
from stratum.schedule.ir import Action, Schedule


def _structure(sched: Schedule) -> None:
    """Each action on the owning rank, in range, exactly once; every pair complete; no B/IW mixing."""
    S, m, P = sched.num_stages, sched.num_microbatches, sched.num_ranks
    owned = set(sched.stage_to_rank)
    empty = [r for r in range(P) if r not in owned]
    if empty:
        raise StratumError(f"schedule {sched.name}: rank(s) {empty} hold no stage; drop them or map a stage there")
    counts: Counter[Action] = Counter()
    for r, a in sched.all_actions():
        if a.stage >= S:
            raise StratumError(f"schedule {sched.name}: action {a} on rank {r} names stage {a.stage}, "
                               f"but there are only stages 0..{S - 1}")
        if a.mb >= m:
            raise StratumError(f"schedule {sched.name}: action {a} on rank {r} names micro-batch {a.mb}, "
                               f"but there are only micro-batches 0..{m - 1}")
        owner = sched.stage_to_rank[a.stage]
        if owner != r:
            raise StratumError(f"schedule {sched.name}: action {a} is on rank {r}, but stage {a.stage} "
                               f"belongs to rank {owner}")
        counts[a] += 1
    dups = sorted(a for a, c in counts.items() if c > 1)
    if dups:
        raise StratumError(f"schedule {sched.name}: duplicate action(s) " + ", ".join(
            f"{a} ({counts[a]} times)" for a in dups[:5]))
    for s in range(S):
        for mb in range(m):
            has = {k: Action(k, s, mb) in counts for k in "FBIW"}
            if not has["F"]:
                raise StratumError(f"schedule {sched.name}: missing action F{s}.{mb}")
            if has["B"] and (has["I"] or has["W"]):
                raise StratumError(f"schedule {sched.name}: stage {s} micro-batch {mb} has both B and I/W; "
                                   "use either the full backward B or the split I + W")
            if not has["B"]:
                if not has["I"] and not has["W"]:
                    raise StratumError(f"schedule {sched.name}: missing action B{s}.{mb} (or I{s}.{mb} + W{s}.{mb})")
                if not has["I"]:
                    raise StratumError(f"schedule {sched.name}: missing action I{s}.{mb} (W{s}.{mb} needs it)")
                if not has["W"]:
                    raise StratumError(f"schedule {sched.name}: missing action W{s}.{mb} (I{s}.{mb} has no W)")


def _local_order(sched: Schedule) -> None:
    """A dependency on the same rank must come earlier in that rank's list."""
    for r, acts in enumerate(sched.actions):
        pos = {a: k for k, a in enumerate(acts)}
        for k, a in enumerate(acts):
            for d in sched.deps(a):
                if d in pos and pos[d] > k:
                    raise StratumError(f"schedule {sched.name}: wrong order on rank {r}: {a} (position {k}) "
                                       f"comes before {d} (position {pos[d]}), which it needs")


def _deadlock(sched: Schedule) -> None:
    """Run every rank's list in order with instant actions; report the ranks that can never proceed.

    A rank that stops at a missing input is parked on that input and woken when it is produced, so each action
    and each of its dependencies is looked at a bounded number of times: linear in the schedule's size, where
    sweeping every rank until nothing moves is quadratic in the ranks."""
    done: set[Action] = set()
    ptr = [0] * sched.num_ranks
    parked: dict[Action, list[int]] = {}
    ready = deque(range(sched.num_ranks))
    while ready:
        r = ready.popleft()
        acts = sched.actions[r]
        while ptr[r] < len(acts):
            a = acts[ptr[r]]
            missing = next((d for d in sched.deps(a) if d not in done), None)
            if missing is not None:
                parked.setdefault(missing, []).append(r)
                break
            done.add(a)
            ptr[r] += 1
            ready.extend(parked.pop(a, ()))
    stuck = []
    for r, acts in enumerate(sched.actions):
        if ptr[r] < len(acts):
            a = acts[ptr[r]]
            waits = [f"{d} on rank {sched.stage_to_rank[d.stage]}" for d in sched.deps(a) if d not in done]
            stuck.append(f"rank {r} at {a} waits for {', '.join(waits)}")
    if stuck:
        raise StratumError(f"schedule {sched.name}: deadlock: " + "; ".join(stuck))


def validate(sched: Schedule) -> None:
    """Raise :class:`StratumError` naming the first problem found, or return ``None`` if the schedule can run.

    Checks, in order: ranks all hold a stage; each action is in range and on the rank owning its stage; no
    duplicates; every (stage, mb) has F and either B or I + W; same-rank dependencies come first in the list;
    and no deadlock under the semantics in the module docstring.
    """
    _structure(sched)
    _local_order(sched)
    _deadlock(sched)


# ---- point-to-point messages --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Transfer:
    """One tensor crossing a stage boundary.

    ``tensor`` is ``"act"`` (output activation of ``src_stage``, going forward) or ``"grad"`` (gradient of
    ``dst_stage``'s output w.r.t. the loss, going backward). ``local`` is True when both stages share a rank.
    """

    tensor: str
    src_stage: int
    dst_stage: int
    mb: int
    src_rank: int
    dst_rank: int

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    def __str__(self) -> str:
        return (f"{self.tensor}[{self.src_stage}->{self.dst_stage}].{self.mb} "
                f"r{self.src_rank}->r{self.dst_rank}{' (local)' if self.local else ''}")


@dataclass(frozen=True, kw_only=True)
class ActionComm:
    """What one action receives before it runs and sends after it finishes."""

    action: Action
    recv: tuple[Transfer, ...]
    send: tuple[Transfer, ...]


def _transfers(sched: Schedule, a: Action) -> tuple[tuple[Transfer, ...], tuple[Transfer, ...]]:
    s, mb, S, where = a.stage, a.mb, sched.num_stages, sched.stage_to_rank
    recv: list[Transfer] = []
    send: list[Transfer] = []
    if a.kind == "F":
        if s > 0:
            recv.append(Transfer(tensor="act", src_stage=s - 1, dst_stage=s, mb=mb,
                                 src_rank=where[s - 1], dst_rank=where[s]))
        if s + 1 < S:
            send.append(Transfer(tensor="act", src_stage=s, dst_stage=s + 1, mb=mb,
                                 src_rank=where[s], dst_rank=where[s + 1]))
    elif a.kind in "BI":
        if s + 1 < S:
            recv.append(Transfer(tensor="grad", src_stage=s + 1, dst_stage=s, mb=mb,
                                 src_rank=where[s + 1], dst_rank=where[s]))
        if s > 0:
            send.append(Transfer(tensor="grad", src_stage=s, dst_stage=s - 1, mb=mb,
                                 src_rank=where[s], dst_rank=where[s - 1]))
    return tuple(recv), tuple(send)


def comm_plan(sched: Schedule) -> list[list[ActionComm]]:
    """Per rank, in action order: the transfers to receive before and send after each action."""
    return [[ActionComm(action=a, recv=(t := _transfers(sched, a))[0], send=t[1]) for a in acts]
            for acts in sched.actions]


def messages(sched: Schedule) -> list[Transfer]:
    """All cross-rank transfers (local hand-offs excluded), in sender order, rank by rank."""
    return [t for plan in comm_plan(sched) for ac in plan for t in ac.send if not t.local]


def channel_order_mismatches(sched: Schedule) -> list[str]:
    """Channels ``(src, dst)`` where the sender's send order differs from the receiver's receive order.

    Irrelevant with tagged point-to-point (gloo) or when receives are matched by tensor identity; it matters
    for a transport that pairs messages on a channel first-in-first-out (NCCL ignores tags).
    """
    sends: dict[tuple[int, int], list[Transfer]] = {}
    recvs: dict[tuple[int, int], list[Transfer]] = {}
    for plan in comm_plan(sched):
        for ac in plan:
            for t in ac.send:
                if not t.local:
                    sends.setdefault((t.src_rank, t.dst_rank), []).append(t)
            for t in ac.recv:
                if not t.local:
                    recvs.setdefault((t.src_rank, t.dst_rank), []).append(t)
    out = []
    for ch in sorted(sends):
        if sends[ch] != recvs.get(ch, []):
            k = next(i for i, (x, y) in enumerate(zip(sends[ch], recvs[ch])) if x != y)
            out.append(f"r{ch[0]}->r{ch[1]}: message {k} is sent as {sends[ch][k]} but received as {recvs[ch][k]}")
    return out
