"""Placement-independent checkpoints of the offload engine: ``state()`` gathers every parameter and its AdamW
state by name from wherever its chunk lives (device slot, host, disk), ``load_state()`` scatters them back, so a
run saved under one placement resumes under another or under the plain engine. Buffers are not chunked: they
stay in the model, on the device, and are read and written there by canonical name.

``StateIO`` is a mixin of :class:`~stratum.offload.engine.OffloadEngine`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from stratum.model.neutral import buffers_to_cpu, load_buffers
from stratum.offload.chunk_state import ChunkState
from stratum.offload.engine_state import EngineState
from stratum.offload.tiers import DISK, aligned_empty
from stratum.runtime.engine import TrainState, merge_states


class StateIO(EngineState):
    """Mixin: the engine's ``state`` and ``load_state`` (see the module docstring)."""

    def master_params(self, c: ChunkState) -> Tensor:
        """The chunk's current parameters as a CPU tensor, from wherever the authoritative copy is."""
        if c.pinned:
            src = c.p() if c.hp is None else c.hp
            return src.detach().cpu().clone()
        if c.slot is not None and c.dirty:
            self.xfer.wait(c.fut)
            return c.p().detach().cpu().clone()
        if c.hp is not None:
            return c.hp.detach().cpu().clone()
        return self._disk.read(f"p{c.i}", aligned_empty(c.cap))

    def _moments(self, c: ChunkState) -> tuple[Tensor, Tensor]:
        if self.placement.optimizer_tier == DISK:
            return self._disk.read(f"m{c.i}", aligned_empty(c.cap)), self._disk.read(f"v{c.i}", aligned_empty(c.cap))
        m, v = c.moments()
        return m.detach().cpu().clone(), v.detach().cpu().clone()

    def state(self) -> TrainState:
        return merge_states(self.state_parts())

    def state_parts(self) -> Iterator[TrainState]:
        """The state a chunk at a time (its parameters and AdamW state, read from wherever they live), then the
        frozen parameters, buffers and loss scale: a checkpoint of a model larger than RAM holds one chunk's
        tensors at a time."""
        self._flush_pending()
        for c in self.chunks:
            yield self._chunk_state(c)
        managed = {e.name for c in self.chunks for e in c.spec.entries}
        # parameters the engine does not manage (frozen) are read from the model
        frozen = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if n not in managed}
        yield TrainState(params=frozen, buffers=buffers_to_cpu(self.model),
                         scaler=self.scaler.state() if self.scaler is not None else {})

    def _chunk_state(self, c: ChunkState) -> TrainState:
        flat = self.master_params(c)
        # (another replica holds the AdamW state of the chunks this one does not own)
        moments = self._moments(c) if self.owns(c.i) else None
        params: dict[str, Tensor] = {}
        optim: dict[str, dict[str, Tensor]] = {}
        for e, stepv in zip(c.spec.entries, c.step_counts().tolist()):
            sl = slice(e.offset, e.offset + e.numel)
            params[e.name] = flat[sl].view(e.shape).clone()
            if stepv > 0 and moments is not None:  # never updated: no optimizer state, as torch's AdamW
                m, v = moments
                optim[e.name] = {"step": torch.tensor(stepv, dtype=torch.float32),
                                 "exp_avg": m[sl].view(e.shape).clone(), "exp_avg_sq": v[sl].view(e.shape).clone()}
        return TrainState(params=params, optim=optim)

    def set_params(self, c: ChunkState, flat: Tensor) -> None:
        """Replace ``c``'s parameters (a CPU tensor of its capacity) in every copy of them: the device slot, the
        host copy or the disk file."""
        if c.slot is not None:
            c.p().copy_(flat)
        if c.hp16 is not None:
            c.hp16.copy_(flat)
        if c.hp is not None:
            c.hp.copy_(flat)
        elif not c.pinned:
            self._disk.write(f"p{c.i}", flat)
        c.dirty = False

    def load_state(self, state: TrainState) -> None:
        self.drain()
        if self._dpu:
            self._drop_delayed()
        for c in self.chunks:
            c.pending = None  # the loaded parameters and moments replace an update still waiting for a fetch
            flat, m, v = (aligned_empty(c.cap).zero_() for _ in range(3))
            steps = [0.0] * len(c.spec.entries)
            for k, e in enumerate(c.spec.entries):
                sl = slice(e.offset, e.offset + e.numel)
                flat[sl] = state.params[e.name].reshape(-1)
                st = state.optim.get(e.name)
                if st:
                    m[sl] = st["exp_avg"].reshape(-1)
                    v[sl] = st["exp_avg_sq"].reshape(-1)
                    steps[k] = float(st["step"])
            self.set_params(c, flat)
            if not self.owns(c.i):
                pass
            elif self.placement.optimizer_tier == DISK:
                self._disk.write(f"m{c.i}", m)
                self._disk.write(f"v{c.i}", v)
            else:
                cm, cv = c.moments()
                cm.copy_(m)
                cv.copy_(v)
            c.step_counts().copy_(torch.tensor(steps))
            c.uniform = len(set(steps)) == 1
        load_buffers(self.model, state.buffers)
        if self.scaler is not None:
            self.scaler.load(state.scaler)
