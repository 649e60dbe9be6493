"""``split(n, offload(…))``: each split rank's memory engine chunks its own shards (plain tensors) and the run
reproduces the plain engine's losses, state and checkpoints — real gloo processes through ``stratum train``."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratum.ir.plan import parse_plan
from stratum.model.gpt import build_gpt
from stratum.parallel.split import layer_cuts, split_blocks
from stratum.parallel.split_offload import shard_shapes
from stratum.train.trainer import read_metrics, train

from test_parallel_replicate import _same_run, _stratum, hf_config  # noqa: F401 (a fixture)

COMMON = ["model.preset='mini'", "train.steps=10", "train.eval_interval=5", "train.grad_accum=2"]


def _same_losses(got_dir: Path, want_dir: Path) -> None:
    """Losses and eval losses within 1e-5; the checkpoints' whole tensors alike. The sharded products sum in
    another order than the whole ones (the row-parallel bias added after the group's sum), and Adam's update of a
    parameter whose gradient is near zero is near lr·sign(g): such noise moves a lone parameter by up to a few
    lr·1e-3 and a first moment by ~1e-7 after 10 steps, so both are compared at those absolute tolerances; the
    losses are the oracle."""
    _same_run(got_dir, want_dir, param_atol=3e-5, moment_atol=1e-6)


def _rank_state_bytes(preset: str, n: int) -> int:
    """fp32 parameters, gradients and AdamW moments one split rank holds: 1/n of each sharded tensor, the rest
    whole (the same cuts the plan makes)."""
    model = build_gpt(preset, vocab_size=256, seed=0)
    total = sum(p.numel() for p in model.parameters())
    for i in split_blocks(model):
        for path, cut in layer_cuts(model.blocks[i]).items():
            mod = model.blocks[i].get_submodule(path)
            total -= sum(getattr(mod, name).numel() * (n - 1) // n for name, pl in cut.placements.items()
                         if not pl.is_replicate())
    return 16 * total


PLAN = "parallel.plan='split(2, offload(device_budget=40%))'"


@pytest.mark.timeout(300)
def test_split_over_offload_matches_plain(make_cfg, tmp_path):
    """split(2) over a device budget of 40 % of each rank's state (chunks stream), clipped, 10 steps; the device
    tier's peak stays under the budget."""
    train(make_cfg(*COMMON, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*COMMON, out=tmp_path / "so"), PLAN, *COMMON, f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 2 and "device-resident chunks" in out
    _same_losses(tmp_path / "so", tmp_path / "plain")
    budget = 0.4 * _rank_state_bytes("mini", 2)
    peaks = [r["offload_device_peak_bytes"] for r in read_metrics(tmp_path / "so")]
    assert 0 < max(peaks) <= budget


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_split_over_offload_checkpoint_resumes_under_plain(make_cfg, tmp_path):
    """Recomputing activations, saved under split(2, offload(…)) after 5 steps and resumed under plain: the
    losses continue as the uninterrupted run's."""
    train(make_cfg(*COMMON, out=tmp_path / "plain"))
    plan, disk = PLAN, f"offload.disk_dir={str(tmp_path)!r}"
    # recomputed blocks re-run their split collectives in the backward (every rank runs split rank 0's plan)
    out = _stratum(make_cfg(*COMMON, out=tmp_path / "chain"), plan, *COMMON, disk, "offload.activations='recompute'",
                   stop_at=5)
    assert "recompute" in out
    train(make_cfg(*COMMON, out=tmp_path / "chain"))
    _same_losses(tmp_path / "chain", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipelined_split_over_offload_matches_plain(make_cfg, tmp_path):
    """pipeline(2, split(2, offload(…))) on 4 processes under 1F1B, clipped: each stage's split ranks chunk
    their shards; the tied embedding and head are summed over the pipeline ranks as without split."""
    # one sequence of 16 tokens per micro-batch: the micro-batches a stage holds at once fit beside its chunks
    common = [*COMMON, "train.micro_batch_size=1", "data.seq_len=16", "train.grad_accum=4"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "pso"),
                   "parallel.plan='pipeline(2, split(2, offload(device_budget=30%)))'", *common,
                   f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 4 and "device-resident chunks" in out
    _same_losses(tmp_path / "pso", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_replicated_split_over_offload_matches_plain(make_cfg, tmp_path):
    """replicate(2, split(2, offload(…))) on 4 processes, unclipped: each chunk's shard gradients are summed over
    the replicas as the chunk completes and updated inside the backward."""
    common = [*COMMON, "optim.grad_clip=0.0"]
    train(make_cfg(*common, "train.grad_accum=4", out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "rso"),
                   "parallel.plan='replicate(2, split(2, offload(device_budget=40%)))'", *common,
                   f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 4 and "device-resident chunks" in out
    _same_losses(tmp_path / "rso", tmp_path / "plain")


def test_offload_under_split_is_a_plan_and_shows_in_the_table():
    plan = parse_plan("replicate(2, pipeline(2, split(2, offload(device_budget=25%))))")
    assert plan.world_size() == 8 and plan.splits == 2
    assert "1/2 of each layer's heads and MLP (shard 1)" in plan.table(lambda r: [r])
    assert "offload" in plan.table(lambda r: [r])


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("hf_config", ["gpt2", "llama"], indirect=True)
def test_split_over_offload_on_transformers_blocks_matches_plain(make_cfg, tmp_path, hf_config):  # noqa: F811
    """GPT-2 (Conv1D, a fused q|k|v) and Llama (GQA; q, k, v and gate, up reading one replicated input) blocks cut
    into plain shards under split(2, offload(…))."""
    common = ["train.steps=10", "train.eval_interval=5", "model.source='hf'", f"model.hf_path={hf_config!r}",
              "train.grad_accum=4"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "so"), "parallel.plan='split(2, offload(device_budget=600KB))'",
                   *common, f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 2
    _same_losses(tmp_path / "so", tmp_path / "plain")


def test_shard_shapes_hold_what_a_split_rank_holds():
    """What the plan search's planner packs for a split rank: the shards' shapes on the meta device."""
    for n in (2, 4):
        model = build_gpt("mini", vocab_size=256, seed=0, device="meta")
        shard_shapes(model, n)
        assert 16 * sum(p.numel() for p in model.parameters()) == _rank_state_bytes("mini", n)
        assert all(p.is_meta for p in model.parameters())
