"""The offload engine's stage hook (a multi-job scheduler prefetches a waiting job's next shard through it): called
at every block boundary it moves chunks the engine's own prefetch could not (their slots were in use), and the
losses stay the plain engine's, exactly."""

from __future__ import annotations

import pytest

from stratum.model.gpt import build_gpt
from stratum.offload.engine import OffloadEngine
from stratum.offload.tasks import Turn, set_gate
from stratum.offload.tiers import DISK, HOST

from offload_helpers import DEV, assert_same, plain, plan, profile, run, spec, state_bytes


@pytest.mark.parametrize("optimizer_tier", [HOST, DISK])
def test_staging_at_every_boundary_moves_chunks_and_stays_exact(optimizer_tier):
    def mk():
        return build_gpt("tiny", vocab_size=256, seed=0)
    m = mk()
    S = state_bytes(m)
    p = plan(m, profile(m), device_budget=S // 2, chunk_elems=29_120, resident_chunks=3, optimizer_tier=optimizer_tier,
             prefetch_depth=2, host_budget=None if optimizer_tier != DISK else S // 3)
    ref = run(plain(mk()), 5)
    eng = OffloadEngine(m, optim=spec(), device=DEV, placement=p)
    staged: list[tuple[str, int, int]] = []

    def gate(kind: str, block: int, blocks: int, turn: Turn) -> None:
        staged.append((kind, block, turn.stage_next()))

    set_gate(gate)
    try:
        got = run(eng, 5)
    finally:
        set_gate(None)
        eng.close()
    assert_same([r.loss for r in got], [r.loss for r in ref])
    blocks = len(m.blocks)
    assert len(staged) == 5 * 2 * 2 * blocks  # every block's forward and backward, 2 micro-batches, 5 steps
    first_step = staged[:2 * 2 * blocks]
    assert all(n == 0 for *_, n in first_step)  # nothing recorded to prefetch from yet
    assert sum(n for *_, n in staged) > 0  # later steps: chunks the in-block prefetch left behind move early
