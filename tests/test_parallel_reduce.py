"""Reductions over replicas: Adasum's arithmetic and its tree across real gloo processes (2, 3 and 5), and the
mean's gradient buckets started by the backward hooks. The workers are this file run as a script."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from gloo_workers import run_workers

from stratum.ir.plan import parse_plan
from stratum.parallel import adasum
from stratum.runtime.engine import OptimSpec

SPEC = OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)


# ---- Adasum ---------------------------------------------------------------------------------------------------
def test_adasum_of_two_is_the_formula_and_keeps_its_limits():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    want = (1 - a @ b / (2 * a @ a)) * a + (1 - a @ b / (2 * b @ b)) * b
    torch.testing.assert_close(adasum.combine(a, b), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(adasum.combine(a, a), a)  # parallel: averaged
    e1, e2 = torch.eye(2, dtype=torch.float64)
    torch.testing.assert_close(adasum.combine(e1, 3 * e2), e1 + 3 * e2)  # orthogonal: added
    torch.testing.assert_close(adasum.combine(torch.zeros(2, dtype=torch.float64), e1), e1)


def test_adasum_tree_splits_at_the_largest_power_of_two_below_n():
    assert [adasum.split_point(n) for n in (2, 3, 4, 5, 6, 8, 9)] == [1, 2, 2, 4, 4, 4, 8]
    gs = [torch.randn(7, dtype=torch.float64) for _ in range(5)]
    c = adasum.combine
    torch.testing.assert_close(adasum.tree(gs), c(c(c(gs[0], gs[1]), c(gs[2], gs[3])), gs[4]))
    torch.testing.assert_close(adasum.tree(gs[:3]), c(c(gs[0], gs[1]), gs[2]))


# ---- shares and ZeRO-2 layout ---------------------------------------------------------------------------------


# ---- Adasum across processes: every replica gets the tree of all replicas' gradients -----------------------------
def adasum_worker(job_path: str) -> None:
    from stratum.dist.world import join_world
    from stratum.model.gpt import build_gpt
    from stratum.parallel.replicate import ReplicateEngine
    from stratum.runtime.plain import PlainEngine

    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    if job.get("mode") == "overlap":
        overlap_worker(job)
        return
    n = int(os.environ["WORLD_SIZE"])
    plan = parse_plan(f"replicate({n}, reduce=adasum)")
    world = join_world(plan, torch.device("cpu"), backend="gloo", timeout_s=60)
    model = build_gpt("tiny", vocab_size=256, seed=0)
    child = PlainEngine(model, optim=SPEC, device=torch.device("cpu"))
    eng = ReplicateEngine(child, node=plan.replicate, world=world)
    g = torch.Generator().manual_seed(100 + world.rank)  # a different gradient on every replica
    mine = {k: torch.randn(p.shape, generator=g) for k, p in child.grad_params()}
    for k, p in child.grad_params():
        p.grad = mine[k].clone()
    eng._adasum()
    torch.save({"mine": mine, "combined": {k: p.grad.clone() for k, p in child.grad_params()}},
               Path(job["out"]) / f"rank{world.rank}.pt")


def overlap_worker(job: dict) -> None:
    """replicate(2) over the plain engine: every bucket's all-reduce has started before the backward ends."""
    from stratum.data.tokens import Batch
    from stratum.dist.world import join_world
    from stratum.model.gpt import build_gpt
    from stratum.parallel import buckets
    from stratum.parallel.replicate import ReplicateEngine
    from stratum.runtime.plain import PlainEngine

    plan = parse_plan("replicate(2)")
    world = join_world(plan, torch.device("cpu"), backend="gloo", timeout_s=60)
    monkey = buckets.BUCKET_BYTES
    buckets.BUCKET_BYTES = 40_000  # several buckets for a tiny model
    child = PlainEngine(build_gpt("tiny", vocab_size=256, seed=0), optim=SPEC, device=torch.device("cpu"))
    eng = ReplicateEngine(child, node=plan.replicate, world=world)
    buckets.BUCKET_BYTES = monkey
    seen = []
    finish = eng.buckets.finish
    eng.buckets.finish = lambda: (seen.append((len(eng.buckets.started), len(eng.buckets.buckets))), finish())[1]
    g = torch.Generator().manual_seed(world.rank)
    mbs = [Batch(x=torch.randint(0, 256, (2, 16), generator=g), y=torch.randint(0, 256, (2, 16), generator=g))
           for _ in range(4)]
    eng.train_step(mbs, 1e-3)
    Path(job["out"], f"overlap{world.rank}.json").write_text(json.dumps(seen))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_adasum_over_processes_equals_the_tree_in_one_process(tmp_path, n):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"out": str(tmp_path)}))
    run_workers(__file__, job, n, timeout=120)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]
    for name in res[0]["mine"]:
        want = adasum.tree([res[r]["mine"][name] for r in range(n)])
        for r in range(n):
            torch.testing.assert_close(res[r]["combined"][name], want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mean_buckets_start_during_the_backward(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"out": str(tmp_path), "mode": "overlap"}))
    run_workers(__file__, job, 2, timeout=120)
    for r in range(2):
        [(started, total)] = json.loads((tmp_path / f"overlap{r}.json").read_text())
        assert total >= 3 and started == total  # every bucket was started by the hooks, none left for finish()


if __name__ == "__main__":
    adasum_worker(sys.argv[1])
