"""burst(n, widths=…): DeepPool's burst parallelism against the plain engine — real gloo processes.

One job of 4 processes runs every case: the burst(4) plans on all of them, the burst(2) plans on a world of
ranks 0 and 1 (ranks 2 and 3 take no part beyond creating the groups, which is collective); rank 0 also trains
the plain engine on the same batches. This file doubles as
the worker (``python tests/test_parallel_burst.py JOB.json`` with RANK/WORLD_SIZE/MASTER_* set).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from gloo_workers import run_workers

from stratum.data.tokens import Batch
from stratum.errors import StratumError
from stratum.ir.plan import parse_plan
from stratum.model.blockseq import BlockSeq
from stratum.model.gpt import build_gpt
from stratum.model.sequential import example_lm, from_sequential
from stratum.parallel.burst import check_burst_model
from stratum.runtime.engine import OptimSpec

V, T, B, ACCUM, STEPS, RESUMED = 128, 16, 6, 2, 10, 2
SPEC = OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.5)
PATTERNS = {2: {"gpt": (2, 1), "seq": (1, 2, 2)}, 4: {"gpt": (4, 2, 1), "seq": (1, 4, 4, 2)}}
"""Widths cycled over the blocks: on 2 processes GPT's tied embedding and head run at widths 2 and 1 (the tied
gradient is summed over the wider group); B = 6 splits unevenly over 4 processes."""


def build(kind: str) -> BlockSeq:
    if kind == "gpt":
        return build_gpt("tiny", vocab_size=V, seed=3, max_seq_len=T)
    torch.manual_seed(3)
    lm = example_lm(vocab_size=V, seq_len=T, d_model=32)
    lm.insert(1, torch.nn.Dropout(0.5).eval())  # (a layer the caller put in eval mode draws no masks: it runs)
    return from_sequential(lm, vocab_size=V, max_seq_len=T)


def widths_for(kind: str, n: int, blocks: int) -> tuple[int, ...]:
    pattern = PATTERNS[n][kind]
    return tuple(pattern[i % len(pattern)] for i in range(blocks))


def micro_batches(step: int) -> list[Batch]:
    g = torch.Generator().manual_seed(100 + step)
    data = (torch.randint(0, V, (ACCUM * B, 1), generator=g)
            + torch.randint(1, 4, (ACCUM * B, T + 1), generator=g).cumsum(1)) % V
    return [Batch(x=data[m * B:(m + 1) * B, :-1], y=data[m * B:(m + 1) * B, 1:], stream=step * ACCUM + m)
            for m in range(ACCUM)]


def run(engine, steps: range = range(STEPS)) -> dict:
    losses, norms = [], []
    for step in steps:
        r = engine.train_step(micro_batches(step), 3e-3 * min(1.0, (step + 1) / 3))
        losses.append(r.loss)
        norms.append(r.grad_norm)
    return {"losses": losses, "norms": norms, "eval": engine.eval_loss(micro_batches(99)),
            "params": engine.state().params}


# ---- the worker -----------------------------------------------------------------------------------------------
def burst_world(n: int, widths: tuple[int, ...], engines: int):
    """The World of burst(n) on ranks 0 … n−1 of the job; None on the job's other ranks, which only join the
    collective group creations (the burst world's own group and the prefix groups of its ``engines`` engines)."""
    import datetime

    import torch.distributed as dist

    from stratum.dist.world import World, mesh_world
    from stratum.parallel.burst import prefix_groups

    plan = parse_plan(f"burst({n}, widths={':'.join(map(str, widths))})")
    cpu, rank = torch.device("cpu"), dist.get_rank()
    if n == dist.get_world_size():
        return mesh_world(plan, cpu, 60.0)
    group = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=60))
    if rank >= n:
        for _ in range(engines):
            prefix_groups(widths, 60.0)
        return None
    return World(plan=plan, rank=rank, coord=plan.coord(rank), device=cpu, backend="gloo", timeout_s=60.0,
                 groups={"replica": group}, members={"replica": list(range(n)), "stage_rank": [rank],
                                                     "split": [rank]})


def worker(job_path: str) -> None:
    from stratum.dist.launch import destroy_process_group, init_process_group
    from stratum.parallel.burst import BurstEngine
    from stratum.runtime.plain import PlainEngine

    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    cpu = torch.device("cpu")
    init_process_group(world=int(os.environ["WORLD_SIZE"]), plan="test", backend="gloo", device=cpu, timeout_s=60)
    results: dict = {}
    plain: dict = {}  # the reference of both sizes (same model, same batches), trained once per model
    plain_state: dict = {}
    for n in job["sizes"]:
        for kind in ("gpt", "seq"):
            model = build(kind)
            widths = widths_for(kind, n, len(model))
            world = burst_world(n, widths, engines=2)
            if world is None:
                continue
            t0 = time.perf_counter()
            got = run(BurstEngine(model, widths=widths, optim=SPEC, world=world))
            got["wall_s"] = time.perf_counter() - t0
            got["widths"] = widths
            if world.rank == 0 and kind not in plain:
                ref = PlainEngine(build(kind), optim=SPEC, device=cpu)
                plain[kind] = run(ref)
                plain_state[kind] = ref.state()
                plain[kind]["resumed"] = run(ref, range(STEPS, STEPS + RESUMED))["losses"]
            # the plain engine's state after STEPS steps, loaded into a fresh burst engine on every rank
            state = world.share_object(plain_state.get(kind), "replica", "the plain engine's state")
            fresh = BurstEngine(build(kind), widths=widths, optim=SPEC, world=world)
            fresh.load_state(state)
            got["resumed"] = run(fresh, range(STEPS, STEPS + RESUMED))["losses"]
            if world.rank == 0:
                got["plain"] = plain[kind]
            results[n, kind] = got
    if int(os.environ["RANK"]) == 0:
        torch.save(results, job["out"])
    destroy_process_group()


def spawn_job(tmp_path: Path, sizes: tuple[int, ...], timeout: float = 120) -> dict:
    """One job of ``max(sizes)`` processes running every case; its rank 0's results by (size, model)."""
    out, job = tmp_path / "results.pt", tmp_path / "job.json"
    job.write_text(json.dumps({"out": str(out), "sizes": list(sizes)}))
    run_workers(__file__, job, max(sizes), timeout)
    return torch.load(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return spawn_job(tmp_path_factory.mktemp("burst"), (2, 4))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


# ---- parity over real processes -----------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["gpt", "seq"])
def test_burst_losses_equal_the_plain_engine(results, n, kind):
    r = results[n, kind]
    assert len(set(r["widths"])) > 1 and max(r["widths"]) == n  # really bursts: several widths, all n used
    plain = r["plain"]
    assert plain["losses"][-1] < plain["losses"][0]  # it trains
    assert plain["norms"][0] > SPEC.grad_clip  # clipping is exercised
    for k, (a, b) in enumerate(zip(r["losses"], plain["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"{kind} on {n}: step {k} loss {a} vs plain {b}"
    for k, (a, b) in enumerate(zip(r["norms"], plain["norms"])):
        assert abs(a - b) <= 1e-4 * abs(b), f"{kind} on {n}: step {k} gradient norm {a} vs plain {b}"
    assert abs(r["eval"] - plain["eval"]) <= 1e-5 * abs(plain["eval"])
    # the plain engine's state resumes under the burst plan (parameters and AdamW moments on every holder)
    assert len(r["resumed"]) == RESUMED
    for k, (a, b) in enumerate(zip(r["resumed"], plain["resumed"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"{kind} on {n}: resumed step {k} loss {a} vs plain {b}"
    # rank 0 holds every block: its saved state is the whole model, trained as the plain engine trains it
    assert r["params"].keys() == plain["params"].keys()
    for name, p in plain["params"].items():
        assert rel(r["params"][name], p) <= 1e-3, f"{kind} on {n}: {name} differs by {rel(r['params'][name], p):.1e}"


# ---- refusals before any process ------------------------------------------------------------------------------
def test_burst_refuses_dropout_batchnorm_short_batches_and_wrong_width_counts():
    node = parse_plan("burst(4, widths=4:2:1:1)").burst
    with pytest.raises(StratumError, match="drops out"):
        check_burst_model(build_gpt("tiny", vocab_size=V, seed=0, dropout=0.1, device="meta"), node, 8)
    gpt = build_gpt("tiny", vocab_size=V, seed=0, device="meta")
    check_burst_model(gpt, node, 4)
    with pytest.raises(StratumError, match="raise train.micro_batch_size to at least 4"):
        check_burst_model(gpt, node, 3)
    with pytest.raises(StratumError, match=r"^parallel.plan 'burst\(4, widths=4:2:1\)': widths gives 3 numbers but "
                                           "the model has 4 blocks"):
        check_burst_model(gpt, parse_plan("burst(4, widths=4:2:1)").burst, 8)
    bn = from_sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    with pytest.raises(StratumError, match="batch norm"):
        check_burst_model(bn, parse_plan("burst(2, widths=2:1)").burst, 8)
    # in eval mode neither draws masks nor takes a share's statistics (running ones): both run
    check_burst_model(bn.eval(), parse_plan("burst(2, widths=2:1)").burst, 8)
    check_burst_model(build_gpt("tiny", vocab_size=V, seed=0, dropout=0.1, device="meta").eval(), node, 8)


if __name__ == "__main__":
    worker(sys.argv[1])
