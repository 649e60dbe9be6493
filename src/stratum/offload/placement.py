"""An offload placement: where a model's chunks, optimizer state and activations live, and what the planner
predicts for it (peak bytes per tier, traffic per step, step time). The planner (:mod:`stratum.offload.planner`)
chooses one; the engine (:mod:`stratum.offload.engine`) runs it; :mod:`stratum.offload.step_model` prices it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from stratum.offload.tiers import DEVICE, DISK, F32, HOST, TIERS
from stratum.units import fmt_bytes

KEEP, SPILL, RECOMPUTE = "keep", "offload", "recompute"
ACTIVATIONS = (KEEP, SPILL, RECOMPUTE)
"""What happens to a block's saved activations between its forward and backward: kept on the device, spilled to
the host tier and copied back (activations.py), or dropped and recomputed from the block's input."""


@dataclass(kw_only=True)
class Placement:
    chunk_elems: int
    """fp32 elements per chunk."""
    resident_chunks: int
    """Device chunk slots for streamed chunks (ignored when param_tier = device: all chunks stay there)."""
    optimizer_tier: str
    """Where AdamW's moments live and the update runs: device, host or disk."""
    param_tier: str
    """Home of parameters (and spilled gradients) not on the device: device (all resident), host or disk."""
    prefetch_depth: int
    """Accesses fetched ahead of use (0 = on demand)."""
    activations: str = KEEP
    """keep | offload | recompute (see ACTIVATIONS)."""
    spill_blocks: tuple[int, ...] | None = None
    """With activations = offload: the blocks whose activations are spilled (None = all); the others are
    recomputed — what the host budget cannot hold is recomputed (or spilled to disk) rather than refused."""
    disk_spill_blocks: tuple[int, ...] = ()
    """Of the spilled blocks, those whose activations go to disk (act_ring.py) rather than the host tier."""
    kept_blocks: tuple[int, ...] = ()
    """With activations = offload: the last blocks of the forward, whose activations stay on the device instead
    (neither spilled nor recomputed): their backward comes first, so a spill would be copied straight back. The
    last block is free (its activations are on the device when the backward starts anyway); more cost device bytes
    that would otherwise hold chunk slots."""
    recomputes_some: bool = False
    """With activations = offload: some blocks are recomputed (not every block is in spill_blocks)."""
    deferred_chunks: tuple[int, ...] = ()
    """On a CPU without clipping: chunks whose gradient goes home and whose update runs beside the next forward
    instead of in the backward (the first whose gradients complete). The backward is where a disk plan's
    traffic piles up (moments read and written, parameters re-read); this moves some of it to the forward."""
    inflight: tuple[int, ...] = ()
    """On a pipeline rank: per block, the micro-batches its stage holds at once under the schedule (empty: the
    engine runs its micro-batches one after another). There activations = recompute keeps each block's input
    (its checkpoint) per in-flight micro-batch on the device and recomputes the block in the backward; offload
    also spills the checkpoints to the host tier until their micro-batch's backward fetches them
    (stage_blocks.py)."""
    half_params: bool = False
    """Mixed-precision placement (train.precision = bf16 or fp16, optimizer state off the device;
    ``step_model.half_chunks``): the device's chunks (slots and pinned chunks) hold 16-bit working copies of the
    parameters, the fp32 masters and AdamW moments stay on the host or the disk (a disk master's 16-bit copy in
    host RAM), gradients go down in 16 bits and are accumulated in fp32 on the host, where the update runs."""
    chunk_grads: bool = False
    """With half_params: the 16-bit gradients go to the host a chunk at a time — summed on the device in a flat
    buffer per chunk, one copy per chunk and micro-batch to pinned staging, added to the chunk's fp32 accumulator
    on the host (grad_handoff.py) — not one copy per tensor as autograd makes it (``offload.grad_handoff``)."""
    device_budget: int | None = None
    host_budget: int | None = None
    n_chunks: int = 0
    pinned_elems: int = 0
    """fp32 elements of the pinned chunks (tied tensors; outliers larger than a chunk: ChunkSpec.pinned), which
    stay on the device; 0: none."""
    act_bytes: float = 0
    predicted_peak: dict = field(default_factory=dict)
    """Tier → predicted peak bytes (device includes activations)."""
    predicted_traffic: dict = field(default_factory=dict)
    """Link → bytes per step: h2d, d2h, disk_read, disk_write."""
    predicted_step_s: float = 0.0
    compute_s: float = 0.0
    disk_s: float = 0.0
    """Seconds of this step's disk traffic at the measured bandwidths (the physical bound of a disk plan)."""
    copy_s: float = 0.0
    """Seconds of this step's host↔device copies at the measured bandwidths."""
    candidates: int = 0
    search_bound: int | None = None
    """The candidate bound the search stopped at (planner.MAX_EVALUATIONS) before trying every candidate; None
    when it tried them all."""

    @property
    def search_cut(self) -> bool:
        return self.search_bound is not None

    @property
    def recompute(self) -> bool:
        return self.activations == RECOMPUTE

    @property
    def uses_disk(self) -> bool:
        return self.param_tier == DISK or self.optimizer_tier == DISK or bool(self.disk_spill_blocks)

    def to_dict(self) -> dict:
        return asdict(self)

    def spilled(self, n_blocks: int) -> frozenset[int]:
        """The blocks whose activations this plan spills (none unless activations = offload)."""
        if self.activations != SPILL:
            return frozenset()
        every = frozenset(range(n_blocks)) if self.spill_blocks is None else frozenset(self.spill_blocks)
        return every - frozenset(self.kept_blocks)

    def kept(self) -> frozenset[int]:
        """The blocks whose activations stay on the device between forward and backward under this plan."""
        return frozenset(self.kept_blocks) if self.activations == SPILL else frozenset()

    def _stage_acts_text(self) -> str:
        """Activations of a pipeline rank (Placement.inflight)."""
        most = max(self.inflight, default=1)
        held = {KEEP: "kept on the device", RECOMPUTE: "block inputs kept on the device, blocks recomputed",
                SPILL: "block inputs spilled to the host, blocks recomputed"}[self.activations]
        return f"{self.activations} ({held}; up to {most} micro-batch{'es' if most > 1 else ''} in flight)"

    def _acts_text(self) -> str:
        if self.inflight:
            return self._stage_acts_text()
        keep = f", kept on the device for the last {len(self.kept_blocks)}" if self.kept_blocks else ""
        if self.activations != SPILL or self.spill_blocks is None:
            return self.activations + (keep if self.activations == SPILL else "")
        disk = len(self.disk_spill_blocks)
        # (the kept blocks need not be among spill_blocks: a spill set chosen by the host's room may leave them out)
        to_host = len(frozenset(self.spill_blocks) - frozenset(self.kept_blocks)) - disk
        text = f"offload for {to_host} blocks"
        if disk:
            text += f", to disk for {disk}"
        return text + keep + (", recompute for the rest" if self.recomputes_some else "")

    def _updates_text(self) -> str:
        masters = DISK if self.param_tier == DISK else HOST  # (a pinned chunk's master is on the host)
        half = f"; 16-bit working copies on the device, fp32 masters on the {masters}" if self.half_params else ""
        if self.chunk_grads:
            half += ", gradients down a chunk at a time"
        if not self.deferred_chunks:
            return half
        return f"{half}; updates of {len(self.deferred_chunks)} chunks beside the next forward"

    def describe(self) -> str:
        tr = self.predicted_traffic
        res = "all" if self.param_tier == DEVICE else str(self.resident_chunks)
        if self.pinned_elems and self.param_tier != DEVICE:
            res += f" + pinned {fmt_bytes(self.pinned_elems * F32)}"
        lines = [
            f"offload plan: {self.n_chunks} chunks of {fmt_bytes(self.chunk_elems * F32)}; device-resident chunks "
            f"{res}; parameters' home {self.param_tier}; optimizer state on {self.optimizer_tier}; prefetch depth "
            f"{self.prefetch_depth}; activations: {self._acts_text()}{self._updates_text()} ({self.candidates} "
            f"candidates{f'; the search stopped at its bound of {self.search_bound:,}' if self.search_cut else ''})",
            f"  {'tier':<7} {'budget':>12} {'predicted peak':>15}",
        ]
        budgets = {DEVICE: self.device_budget, HOST: self.host_budget, DISK: None}
        for t in TIERS:
            lines.append(f"  {t:<7} {fmt_bytes(budgets[t]):>12} {fmt_bytes(self.predicted_peak.get(t, 0)):>15}")
        lines.append(f"  traffic per step: host→device {fmt_bytes(tr.get('h2d', 0))}, device→host "
                     f"{fmt_bytes(tr.get('d2h', 0))}, disk read {fmt_bytes(tr.get('disk_read', 0))}, disk write "
                     f"{fmt_bytes(tr.get('disk_write', 0))}")
        lines.append(f"  predicted step time {self.predicted_step_s:.3f} s (compute {self.compute_s:.3f} s; disk "
                     f"{self.disk_s:.3f} s and host↔device copies {self.copy_s:.3f} s at the measured bandwidths; "
                     f"activations {fmt_bytes(self.act_bytes)} "
                     f"{'in flight' if self.inflight else 'per micro-batch'})")
        return "\n".join(lines)
