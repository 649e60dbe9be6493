"""The Plan tree: how one training job runs over processes — Whale's primitives as data.

A plan is a tree of six node kinds, read from an expression such as ``replicate(2, pipeline(2, split(2)))``:

- ``replicate(n, reduce=mean|adasum, shard=false|true)`` — data parallel over ``n`` replicas of its child;
  ``shard=true`` gives each replica 1/n of the gradients and optimizer state (ZeRO-2);
- ``pipeline(ranks, schedule=…, partition=…, virtual=…, waves=…)`` — the blocks cut into stages over ``ranks``
  processes, driven by a pipeline schedule;
- ``split(n)`` — tensor parallelism inside blocks over ``n`` processes;
- ``offload(device_budget=…, host_budget=…)`` — the memory engine: training state over device, host and disk;
- ``local`` — the plain leaf: the blocks it is given, on one device, torch autograd and AdamW;
- ``burst(n, widths=4:2:1…, amplification=…)`` — DeepPool's burst parallelism over ``n`` processes: block i runs on
  the first ``widths[i]`` of them with each micro-batch's samples split between them (empty widths: planned at
  start from a profile, :mod:`stratum.plan.burst`). It stands alone (holds only ``local``, nothing holds it); its
  processes lie along the replica dimension of the mesh, but it splits micro-batches rather than multiplying them.

Nesting runs from the outside in as replicate → pipeline → split → leaf: a node may only hold nodes to its
right, since each one splits the work its parent hands it (replicas take micro-batches, stages take blocks,
splits take the tensors inside blocks). A node with no child holds ``local``.

Processes form one mesh of shape ``(replicas, stages, splits)`` in that order; :class:`Coord` is a rank's place
in it and everything about a rank — which replica, which pipeline rank, which split — is derived here and only
here (:meth:`Plan.coord`, :meth:`Plan.rank_of`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TypeVar

from stratum.errors import StratumError

REDUCE_KINDS = ("mean", "adasum")
MAX_PROCESSES = 65_536
"""The most processes a plan may need: more than any job here runs, so a larger plan is a typo, whose rank tables,
schedules and process groups would never be built (replicate(10**20) would not end)."""


@dataclass(frozen=True, kw_only=True)
class Local:
    """The plain leaf."""

    def args(self) -> list[str]:
        return []


@dataclass(frozen=True, kw_only=True)
class Offload:
    """The memory engine as the leaf; empty budgets mean the ``[offload]`` section's."""

    device_budget: str = ""
    """Bytes the device tier may hold ("2GB", "25%" of the training state); "" = [offload] device_budget."""
    host_budget: str = ""
    """Bytes of host RAM below the device; "" = [offload] host_budget."""

    def args(self) -> list[str]:
        return [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name)]


@dataclass(frozen=True, kw_only=True)
class Split:
    """Tensor parallelism inside blocks over ``n`` processes."""

    n: int
    child: Node = field(default_factory=Local)

    def args(self) -> list[str]:
        return [str(self.n)]


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Stages over ``ranks`` processes; omitted settings come from the ``[pipeline]`` section."""

    ranks: int
    schedule: str = "1f1b"
    partition: str = "even"
    virtual: int = 2
    waves: int = 1
    child: Node = field(default_factory=Local)

    def args(self) -> list[str]:
        return [str(self.ranks), f"schedule={self.schedule}", f"partition={self.partition}"] + \
            ([f"virtual={self.virtual}"] if self.schedule == "interleaved" else []) + \
            ([f"waves={self.waves}"] if "wave" in self.schedule else [])


@dataclass(frozen=True, kw_only=True)
class Replicate:
    """Data parallel over ``n`` replicas of the child."""

    n: int
    reduce: str = "mean"
    """How replicas' gradients combine: mean (the plain engine's average) or adasum."""
    shard: bool = False
    """ZeRO-2: each replica keeps 1/n of the gradients and AdamW state (reduce-scatter, update, all-gather)."""
    child: Node = field(default_factory=Local)

    def args(self) -> list[str]:
        return [str(self.n)] + ([f"reduce={self.reduce}"] if self.reduce != "mean" else []) + \
            (["shard=true"] if self.shard else [])


@dataclass(frozen=True, kw_only=True)
class Burst:
    """Burst parallelism: a device count per block over ``n`` processes (see the module docstring)."""

    n: int
    widths: str = ""
    """Processes per block, separated by ':' (e.g. "4:2:1:1"), each in 1..n; "" = planned from a profile."""
    amplification: float = 2.0
    """The planner's limit on a block's device-seconds relative to its one-process cost (DeepPool's)."""
    child: Node = field(default_factory=Local)

    def width_list(self) -> tuple[int, ...]:
        """``widths`` as numbers; () when the planner chooses them."""
        try:
            return tuple(int(w) for w in self.widths.split(":")) if self.widths.strip() else ()
        except ValueError:
            raise StratumError(f"burst(widths={self.widths}) must be whole numbers separated by ':', e.g. "
                               "4:2:1") from None

    def args(self) -> list[str]:
        return [str(self.n)] + ([f"widths={self.widths}"] if self.widths else []) + \
            ([f"amplification={self.amplification:g}"] if self.amplification != 2.0 else [])


Node = Replicate | Pipeline | Split | Offload | Local | Burst
_K = TypeVar("_K", Replicate, Pipeline, Split, Burst)
NAMES: dict[str, type] = {"replicate": Replicate, "pipeline": Pipeline, "split": Split, "offload": Offload,
                          "local": Local, "burst": Burst}
# what each kind may hold: the kinds to its right in replicate → pipeline → split → leaf
_MAY_HOLD: dict[type, tuple[type, ...]] = {
    Replicate: (Pipeline, Split, Offload, Local),
    Pipeline: (Split, Offload, Local),
    Split: (Offload, Local),
    Burst: (Local,),
}


def node_name(node: Node) -> str:
    return next(k for k, v in NAMES.items() if isinstance(node, v))


def render(node: Node) -> str:
    """The canonical expression of ``node`` (parses back to an equal tree)."""
    args = node.args()
    child = getattr(node, "child", None)
    if child is not None and not isinstance(child, Local):
        args.append(render(child))
    name = node_name(node)
    return f"{name}({', '.join(args)})" if args else name


@dataclass(frozen=True)
class Coord:
    """A rank's place in the mesh (replica, pipeline rank, split index)."""

    replica: int
    stage_rank: int
    split: int


@dataclass(frozen=True)
class Plan:
    """A validated plan tree and the mesh it implies; build it with :func:`parse_plan`."""

    root: Node

    def _find(self, kind: type[_K]) -> _K | None:
        node: Node | None = self.root
        while node is not None:
            if isinstance(node, kind):
                return node
            node = getattr(node, "child", None)
        return None

    @property
    def replicate(self) -> Replicate | None:
        return self._find(Replicate)

    @property
    def pipeline(self) -> Pipeline | None:
        return self._find(Pipeline)

    @property
    def split(self) -> Split | None:
        return self._find(Split)

    @property
    def burst(self) -> Burst | None:
        return self._find(Burst)

    @property
    def leaf(self) -> Offload | Local:
        node = self.root
        while (child := getattr(node, "child", None)) is not None:
            node = child
        assert isinstance(node, (Offload, Local))  # (check: only a leaf kind holds no child)
        return node

    @property
    def replicas(self) -> int:
        return self.replicate.n if self.replicate else 1

    @property
    def stage_ranks(self) -> int:
        return self.pipeline.ranks if self.pipeline else 1

    @property
    def splits(self) -> int:
        return self.split.n if self.split else 1

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """(replicas, pipeline ranks, splits): the process mesh, outermost first (a burst node's processes
        along the first)."""
        return self.burst.n if self.burst else self.replicas, self.stage_ranks, self.splits

    def world_size(self) -> int:
        r, p, s = self.mesh_shape
        return r * p * s

    def coord(self, rank: int) -> Coord:
        r, p, s = self.mesh_shape
        if not 0 <= rank < r * p * s:
            raise StratumError(f"rank {rank} is outside the plan's {r * p * s} processes")
        return Coord(replica=rank // (p * s), stage_rank=rank // s % p, split=rank % s)

    def rank_of(self, c: Coord) -> int:
        _, p, s = self.mesh_shape
        return (c.replica * p + c.stage_rank) * s + c.split

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` only along ``dim`` (replica, stage_rank or split), in order."""
        c = self.coord(rank)
        size = dict(zip(("replica", "stage_rank", "split"), self.mesh_shape))[dim]
        return [self.rank_of(replace(c, **{dim: i})) for i in range(size)]

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, each once, in the order of their first rank (the same on every rank)."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size()):
            g = self.group_ranks(dim, rank)
            seen.setdefault(g[0], g)
        return list(seen.values())

    def table(self, blocks_of: Callable[[int], list[int]]) -> str:
        """Which process holds what: one row per rank, with the blocks ``blocks_of(pipeline rank)`` returns (under
        burst with its widths given, the blocks wider than the rank, the only ones it keeps)."""
        head = f"{'rank':>4}  {'replica':>7}  {'stage rank':>10}  {'split':>5}  {'blocks':<16}  holds"
        rows = [head, "-" * len(head)]
        widths = self.burst.width_list() if self.burst is not None else ()
        for rank in range(self.world_size()):
            c = self.coord(rank)
            held = [i for i, w in enumerate(widths) if w > c.replica] if widths else blocks_of(c.stage_rank)
            rows.append(f"{rank:>4}  {c.replica:>7}  {c.stage_rank:>10}  {c.split:>5}  "
                        f"{ranges_text(held) or 'none':<16}  {self._holds(c)}")
        return "\n".join(rows)

    def _holds(self, c: Coord) -> str:
        parts = []
        if self.split is not None and self.split.n > 1:
            parts.append(f"1/{self.split.n} of each layer's heads and MLP (shard {c.split})")
        if self.replicate is not None and self.replicate.shard and self.replicate.n > 1:
            parts.append(f"1/{self.replicate.n} of the gradients and AdamW state (slice {c.replica})")
        if isinstance(self.leaf, Offload):
            parts.append("training state over device, host and disk (offload)")
        if self.burst is not None:
            parts.append(f"its share of each micro-batch's samples in these blocks (widths {self.burst.widths})"
                         if self.burst.width_list() else
                         f"the blocks wider than {c.replica} (widths planned at start; the column lists every block)")
        return "; ".join(parts) or "whole parameters, gradients and AdamW state"

    def __str__(self) -> str:
        return render(self.root)


def ranges_text(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2, 5``."""
    out: list[str] = []
    for i in sorted(ids):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


# ---- parsing --------------------------------------------------------------------------------------------------
# A hand-written reader: Python's own expression parser would reject the byte sizes users type ("25%", "1GB")
# and a child after keyword arguments, both natural here.
_TOKEN = re.compile(r"\s*(?:([(),=])|([^\s(),=]+))")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise StratumError(f"parallel.plan {text!r}: cannot read it at {text[pos:]!r}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


class _Reader:
    def __init__(self, text: str, defaults: dict[str, dict[str, object]]):
        self.text = text
        self.toks = _tokens(text)
        self.i = 0
        self.defaults = defaults

    def fail(self, why: str) -> StratumError:
        return StratumError(f"parallel.plan {self.text!r}: {why}")

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        t = self.peek()
        if t is None:
            raise self.fail("ends too early (a ')' missing?)")
        self.i += 1
        return t

    def node(self) -> Node:
        name = self.take().lower()
        if name == "plain":
            name = "local"
        if name not in NAMES:
            raise self.fail(f"{name!r} is not a plan node; nodes are: {', '.join(NAMES)}")
        positional: list[object] = []
        keywords: dict[str, str] = {}
        if self.peek() == "(":
            self.take()
            while self.peek() != ")":
                if self.peek() is None:
                    raise self.fail("ends too early (a ')' missing?)")
                self.arg(positional, keywords)
                if self.peek() == ",":
                    self.take()
                elif self.peek() is None:
                    raise self.fail("ends too early (a ')' missing?)")
                elif self.peek() != ")":
                    raise self.fail(f"expected ',' or ')' after an argument of {name}, got {self.peek()!r}")
            self.take()
        return self.build(name, positional, keywords)

    def arg(self, positional: list, keywords: dict) -> None:
        if self.i + 1 < len(self.toks) and self.toks[self.i + 1] == "=":
            key = self.take().lower()
            self.take()
            if key in keywords:
                raise self.fail(f"{key} is given twice")
            if self.peek() in (",", ")"):
                raise self.fail(f"{key}= has no value")
            keywords[key] = self.take()
        elif self.peek() in NAMES or self.peek() == "plain":
            positional.append(self.node())
        else:
            positional.append(self.take())

    def build(self, name: str, positional: list, keywords: dict) -> Node:
        cls = NAMES[name]
        children = [p for p in positional if not isinstance(p, str)]
        values = [p for p in positional if isinstance(p, str)]
        if len(children) > 1:
            raise self.fail(f"{name} holds one child, got {len(children)}")
        if children and cls not in _MAY_HOLD:
            raise self.fail(f"{name} is a leaf: it holds no other node")
        kw: dict[str, object] = dict(self.defaults.get(name, {}))
        size_key = {"replicate": "n", "split": "n", "pipeline": "ranks", "burst": "n"}.get(name)
        if values:
            if size_key is None or len(values) > 1:
                raise self.fail(f"{name} takes {'one number' if size_key else 'no positional value'}, "
                                f"got {', '.join(values)}")
            keywords = {size_key: values[0], **keywords}
        allowed = {f.name: f for f in fields(cls) if f.name != "child"}
        for key, raw in keywords.items():
            if key not in allowed:
                raise self.fail(f"{name} has no setting {key!r}; it takes: {', '.join(allowed) or 'nothing'}")
            kw[key] = _value(self, name, key, raw, allowed[key].type)
        if size_key and size_key not in kw:
            raise self.fail(f"{name} needs its size, e.g. {name}(2)")
        if children:
            kw["child"] = children[0]
        return cls(**{k: v for k, v in kw.items() if k in allowed or k == "child"})


def _value(r: _Reader, name: str, key: str, raw: str, typ: object) -> object:
    typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    if typ == "int":
        try:
            return int(raw)
        except ValueError:
            raise r.fail(f"{name}({key}=…) must be a whole number, got {raw!r}") from None
    if typ == "bool":
        if raw.lower() not in ("true", "false"):
            raise r.fail(f"{name}({key}=…) must be true or false, got {raw!r}")
        return raw.lower() == "true"
    if typ == "float":
        try:
            return float(raw)
        except ValueError:
            raise r.fail(f"{name}({key}=…) must be a number, got {raw!r}") from None
    return raw.strip("'\"")


def check(node: Node, text: str = "") -> None:
    """Refuse a tree that cannot run, with the reason (nesting, sizes, settings)."""
    where = f"parallel.plan {text!r}: " if text else "parallel.plan: "
    for size_key in ("n", "ranks"):
        v = getattr(node, size_key, None)
        if v is not None and v < 1:
            raise StratumError(f"{where}{node_name(node)}({v}) must have at least 1 process")
    if isinstance(node, Replicate) and node.reduce not in REDUCE_KINDS:
        raise StratumError(f"{where}replicate(reduce={node.reduce}) is not one of: {', '.join(REDUCE_KINDS)}")
    if isinstance(node, Replicate) and node.shard and node.reduce == "adasum":
        raise StratumError(f"{where}replicate(reduce=adasum) combines whole gradients, so it cannot shard them; "
                           "use shard=false, or reduce=mean with shard=true")
    if isinstance(node, Burst):
        try:
            widths = node.width_list()
        except StratumError as e:
            raise StratumError(f"{where}{e}") from None
        if any(not 1 <= w <= node.n for w in widths):
            raise StratumError(f"{where}burst(widths={node.widths}): every width must be in 1..{node.n}")
        if not node.amplification >= 1.0:
            raise StratumError(f"{where}burst(amplification={node.amplification:g}) must be >= 1 (a block's "
                               "device-seconds relative to its one-process cost)")
    child: Node | None = getattr(node, "child", None)
    if child is None:
        return
    if not isinstance(child, _MAY_HOLD[type(node)]):
        may = ", ".join(k.__name__.lower() for k in _MAY_HOLD[type(node)])
        raise StratumError(f"{where}{node_name(node)} cannot hold {node_name(child)}: nodes nest as replicate → "
                           f"pipeline → split → offload/local, so {node_name(node)} may hold {may}")
    check(child, text)


def parse_plan(text: str, *, defaults: dict[str, dict[str, object]] | None = None) -> Plan:
    """Read and check a plan expression; ``defaults`` fills settings the expression omits, by node name."""
    r = _Reader(text, defaults or {})
    if not r.toks:
        raise StratumError("parallel.plan is empty; write a plan such as 'local' or 'replicate(2)'")
    root = r.node()
    if r.peek() is not None:
        raise r.fail(f"unexpected {r.peek()!r} after the plan (one root node)")
    check(root, text)
    plan = Plan(root)
    if plan.world_size() > MAX_PROCESSES:
        raise StratumError(f"parallel.plan {text!r} needs {plan.world_size():,} processes; a plan may need at most "
                           f"{MAX_PROCESSES:,}: make its sizes smaller")
    return plan
