"""Packing parameters into fixed-size flat chunks, in first-use order.

Parameters are visited block by block (``BlockSeq.block_param_names``) and appended to the current chunk until
the next one would not fit; then a new chunk starts. Within a chunk the weight-decayed parameters come first, so
the chunk's AdamW runs as two calls over two contiguous ranges (decay, no decay). Tied parameters (one tensor in
several blocks) go to a private chunk of their own, which stays on the device for the whole run; so may the one
or two parameters far larger than the rest (:func:`outliers`: an embedding and a head), where the chunks are
smaller than them. Gradients,
optimizer moments and (with a host optimizer) fp32 master copies follow the chunk: they are flat tensors of
the same length, addressed with the same offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.offload.tiers import ALIGN, round_up
from stratum.runtime.optim import decays

ALIGN_ELEMS = ALIGN // 4
"""Chunk capacities are multiples of this many fp32 elements, so a chunk's flat buffers (and the parameter and
gradient halves of a slot) can be read and written with direct I/O."""

PARAM_ALIGN_ELEMS = 64
"""Each parameter starts at a multiple of this many elements (256 bytes) of its chunk, as a tensor of its own
does (cudaMalloc aligns to 256 bytes). cuBLAS picks its kernels by operand alignment: GPT-2 774M in bf16 on an
H100 trained 2.4e-4 (relative) off the plain engine's losses with parameters packed end to end, and slower."""


@dataclass
class Entry:
    name: str
    """Canonical parameter name."""
    param: nn.Parameter
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class ChunkSpec:
    index: int
    capacity: int
    """Elements of the chunk's flat buffers (the chunk size; a pinned chunk is as large as its content); a
    multiple of ALIGN_ELEMS."""
    entries: list[Entry] = field(default_factory=list)
    n_decay: int = 0
    """Elements of the leading weight-decayed range."""
    used: int = 0
    pinned: bool = False
    """It never streams: it stays on the device for the whole run (the tied chunk, the outliers' chunk)."""
    tied: bool = False
    """It holds the tied tensors (each in several blocks: a gradient contribution from each per micro-batch, which
    the plain engine sums before accumulating them); such a chunk is pinned."""

    @property
    def nbytes(self) -> int:
        return self.capacity * 4


@dataclass
class Layout:
    chunks: list[ChunkSpec]
    block_chunks: list[list[int]]
    """Per block, the chunks its parameters live in, in first-use order."""
    ready_block: dict[int, int]
    """Chunk → the earliest block that uses it: its gradients are complete after that block's backward."""
    chunk_elems: int
    grad_elems: int = 0
    """Gradient elements autograd hands over per micro-batch: each parameter's once for every block that uses it
    (blocks run their backward one at a time, so a tied tensor gets a gradient from each of its blocks)."""

    @property
    def last_block(self) -> dict[int, int]:
        """Chunk → the last block that uses it: its gradients start arriving with that block's backward (the
        mirror of ``ready_block``)."""
        last: dict[int, int] = {}
        for i, cs in enumerate(self.block_chunks):
            for c in cs:
                last[c] = i
        return last

    @property
    def streamable(self) -> list[int]:
        return [c.index for c in self.chunks if not c.pinned]

    def max_chunks_per_block(self) -> int:
        pinned = {c.index for c in self.chunks if c.pinned}
        return max((len([c for c in cs if c not in pinned]) for cs in self.block_chunks), default=0)


def param_order(seq: BlockSeq) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters under canonical names, in first-use order (each once)."""
    params = dict(seq.named_parameters())
    seen, out = set(), []
    for i in range(len(seq)):
        for name in seq.block_param_names(i):
            if name not in seen and params[name].requires_grad:
                seen.add(name)
                out.append((name, params[name]))
    return out


def _finish(spec: ChunkSpec, items: list[tuple[str, nn.Parameter]]) -> ChunkSpec:
    ordered = [it for it in items if decays(*it)] + [it for it in items if not decays(*it)]
    off = 0
    for name, p in ordered:
        off = round_up(off, PARAM_ALIGN_ELEMS)  # the gap holds zeros: AdamW leaves them zero
        spec.entries.append(Entry(name, p, off, p.numel(), tuple(p.shape)))
        off += p.numel()
        if decays(name, p):
            spec.n_decay = off
    spec.used = off
    return spec


def outliers(seq: BlockSeq) -> dict[str, int]:
    """The untied parameters (name → elements) more than twice the size of every other, if there are at most
    two: an embedding and a head far larger than any layer's matrix (a transformers model's untied pair, or on a
    pipeline rank GPT's embedding tied to the head on another rank). Streamed, they would set the smallest chunk
    — every chunk as large as a 50k-row embedding, its slots and staging in proportion — so a layout may pin
    them instead (:func:`pack`)."""
    tied = {g.owner for g in seq.tied}
    sizes = sorted(((p.numel(), n) for n, p in param_order(seq) if n not in tied), reverse=True)
    for k in (2, 1):  # both of a pair where the second is an outlier too (an embedding and a smaller head)
        if len(sizes) > k and sizes[k - 1][0] > 2 * sizes[k][0]:
            return {n: size for size, n in sizes[:k]}
    return {}


def pack(seq: BlockSeq, chunk_elems: int) -> Layout:
    """The chunk layout of ``seq`` with chunks of ``chunk_elems`` fp32 elements, rounded up to a multiple of
    ALIGN_ELEMS (works on meta models): the tied parameters in a pinned chunk of their own, then the outliers
    larger than a chunk in another, then the rest in first-use order."""
    tied_names = {g.owner for g in seq.tied}
    big = {n for n, size in outliers(seq).items() if size > chunk_elems}
    order = param_order(seq)
    biggest = max((p.numel() for n, p in order if n not in tied_names | big), default=0)
    if chunk_elems < biggest:
        raise StratumError(f"offload.chunk_size of {chunk_elems * 4:,} bytes is smaller than the largest parameter "
                           f"({biggest * 4:,} bytes); use at least that")
    chunk_elems = round_up(chunk_elems, ALIGN_ELEMS)
    chunks: list[ChunkSpec] = []
    where: dict[str, int] = {}
    for names, tied in ((tied_names, True), (big, False)):
        items = [(n, p) for n, p in order if n in names]
        if items:
            size = sum(round_up(p.numel(), PARAM_ALIGN_ELEMS) for _, p in items)
            chunks.append(_finish(ChunkSpec(len(chunks), round_up(size, ALIGN_ELEMS), pinned=True, tied=tied),
                                  items))
            where.update((n, chunks[-1].index) for n, _ in items)
    cur: list[tuple[str, nn.Parameter]] = []
    fill = 0
    for n, p in order:
        if n in where:
            continue
        # padded sizes: with every start aligned, any order of the chunk's parameters fits in their sum
        if cur and fill + p.numel() > chunk_elems:
            chunks.append(_finish(ChunkSpec(len(chunks), chunk_elems), cur))
            cur, fill = [], 0
        cur.append((n, p))
        where[n] = len(chunks)
        fill += round_up(p.numel(), PARAM_ALIGN_ELEMS)
    if cur:
        chunks.append(_finish(ChunkSpec(len(chunks), chunk_elems), cur))
    block_chunks = []
    for i in range(len(seq)):
        cs: list[int] = []
        for n in seq.block_param_names(i):
            if n in where and where[n] not in cs:
                cs.append(where[n])
        block_chunks.append(cs)
    ready: dict[int, int] = {}
    for i, cs in enumerate(block_chunks):
        for c in cs:
            ready.setdefault(c, i)
    numel = {n: p.numel() for n, p in order}
    grad_elems = sum(numel[n] for i in range(len(seq)) for n in set(seq.block_param_names(i)) if n in numel)
    return Layout(chunks=chunks, block_chunks=block_chunks, ready_block=ready, chunk_elems=chunk_elems,
                  grad_elems=grad_elems)
