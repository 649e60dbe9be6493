"""The process world's gather of tensor structures to the first member: the structure (mappings, dataclasses)
round-trips in one process, and over 3 real gloo processes every member's structure arrives whole, tensors
equal, a member without one giving None. The workers are this file run as a script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from gloo_workers import run_workers

from stratum.dist.world import _fill, _strip
from stratum.ir.plan import parse_plan
from stratum.runtime.engine import TrainState


def _state(rank: int) -> TrainState | None:
    """Rank ``rank``'s structure: tensors of several dtypes and shapes (a 0-dim one, a non-contiguous view);
    rank 1 has none."""
    if rank == 1:
        return None
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(4, 6, generator=g)
    return TrainState(params={f"blocks.{rank}.w": w.t(), f"blocks.{rank}.b": torch.randn(3, generator=g).bfloat16()},
                      optim={f"blocks.{rank}.w": {"step": torch.tensor(float(rank + 7)),
                                                  "exp_avg": torch.randn(6, 4, generator=g)}},
                      buffers={"ids": torch.arange(rank + 2)})


def _same(a: TrainState | None, b: TrainState | None) -> None:
    assert (a is None) == (b is None)
    if a is None or b is None:
        return
    for got, want in ((a.params, b.params), (a.buffers, b.buffers)):
        assert list(got) == list(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
    assert list(a.optim) == list(b.optim)
    for k, st in b.optim.items():
        assert all(torch.equal(a.optim[k][n], t) for n, t in st.items())


def test_a_structure_round_trips_through_its_skeleton():
    state = _state(2)
    tensors: list[torch.Tensor] = []
    skeleton = _strip(state, tensors)
    assert len(tensors) == 5 and not any(isinstance(v, torch.Tensor) for v in skeleton.params.values())
    it = iter(tensors)
    _same(_fill(skeleton, lambda slot: next(it).clone()), state)


def gather_worker(job_path: str) -> None:
    from stratum.dist.world import join_world

    out = Path(json.loads(Path(job_path).read_text())["out"])
    world = join_world(parse_plan("replicate(3)"), torch.device("cpu"), backend="gloo", timeout_s=60)
    got = world.gather_to_first(_state(world.rank), "replica", "a test structure")
    if world.rank != 0:
        assert got is None
        return
    assert got is not None and len(got) == 3
    for r, st in enumerate(got):
        _same(st, _state(r))
    (out / "ok").write_text("gathered")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_members_structure_arrives_whole_at_the_first(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"out": str(tmp_path)}))
    run_workers(__file__, job, 3, timeout=100)
    assert (tmp_path / "ok").read_text() == "gathered"


if __name__ == "__main__":
    gather_worker(sys.argv[1])
