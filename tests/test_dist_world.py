"""The process world's gather of tensor structures to the first member: the structure (mappings, dataclasses)
round-trips in one process, and over 3 real gloo processes every member's structure arrives whole, tensors
equal, a member without one giving None. The gathered gradient norm over 4 processes (2 replicas × 2 stages,
each parameter's norm on one of them) is the one-process norm bit for bit. The workers are this file run as a
script."""

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


def _norms() -> list[tuple[str, torch.Tensor]]:
    """101 parameters' norms of very different sizes, chosen so that another order or grouping shows in the bits
    (asserted below)."""
    g = torch.Generator().manual_seed(4)
    return [(f"p{i}", torch.randn(64, generator=g).mul(10.0 ** (i % 5 - 2)).norm()) for i in range(101)]


def test_the_test_norms_differ_in_any_other_order_or_grouping():
    """Reversed, as per-rank norms normed, as a float64 sum of squares over 4 ranks: each differs from the
    ordered norm, so the gathered norm's equality below can fail."""
    xs = [x for _, x in _norms()]
    want = torch.linalg.vector_norm(torch.stack(xs), 2.0)
    parts = [torch.stack(xs[r::4]) for r in range(4)]
    assert not torch.equal(torch.linalg.vector_norm(torch.stack(xs[::-1]), 2.0), want)
    assert not torch.equal(torch.linalg.vector_norm(torch.stack([p.norm() for p in parts]), 2.0), want)
    assert not torch.equal(sum(p.double().pow(2).sum() for p in parts).sqrt().float(), want)


def norm_worker(job_path: str) -> None:
    from stratum.dist.world import join_world

    out = Path(json.loads(Path(job_path).read_text())["out"])
    world = join_world(parse_plan("replicate(2, pipeline(2))"), torch.device("cpu"), backend="gloo", timeout_s=60)
    named = _norms()
    mine = named[world.rank::4]
    got = world.gathered_norm(mine[::-1], [n for n, _ in named], ("replica", "stage_rank"))
    want = torch.linalg.vector_norm(torch.stack([x for _, x in named]), 2.0)
    assert torch.equal(got, want), (float(got), float(want))
    (out / f"norm-{world.rank}").write_text("equal")


def _run(tmp_path: Path, case: str, world: int) -> None:
    """This file's ``case`` worker as ``world`` gloo processes, writing into ``tmp_path``."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"out": str(tmp_path), "case": case}))
    run_workers(__file__, job, world, timeout=100)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_members_structure_arrives_whole_at_the_first(tmp_path):
    _run(tmp_path, "gather", 3)
    assert (tmp_path / "ok").read_text() == "gathered"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_norm_gathered_over_replicas_and_stages_is_one_processs_bit_for_bit(tmp_path):
    _run(tmp_path, "norm", 4)
    assert sorted(p.name for p in tmp_path.glob("norm-*")) == [f"norm-{r}" for r in range(4)]


if __name__ == "__main__":
    case = json.loads(Path(sys.argv[1]).read_text())["case"]
    {"gather": gather_worker, "norm": norm_worker}[case](sys.argv[1])
