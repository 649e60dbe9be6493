"""The pipeline node over the offload leaf: each rank's stages stream their chunks through its own tiers, its
in-flight micro-batches' activations kept, checkpointed or spilled as its plan says, and the run reproduces the
plain engine's losses and state — real gloo processes through ``stratum train``."""

from __future__ import annotations

import pytest

from stratum.train.trainer import read_metrics, train

from test_parallel_replicate import _same_run, _stratum, hf_config  # noqa: F401 (a fixture)

# one sequence per micro-batch; dropout on: a recomputed block must draw the masks its first forward drew
DROPOUT = "model.dropout=0.1"
COMMON = ["train.steps=4", "train.eval_interval=2", "model.preset='mini'", "train.micro_batch_size=1",
          "train.grad_accum=4", DROPOUT]
# sequences of 64 tokens: rank 0 of 1F1B holds two micro-batches in flight, whose activations (3.3 MB with its
# streamed chunks) do not fit this budget; their block inputs do (1.8 MB)
ONE_F_ONE_B = [*COMMON, "data.seq_len=64"]
BUDGET = 2_200_000
PLAN = f"parallel.plan='pipeline(2, offload(device_budget={BUDGET}B))'"


def test_dry_run_fits_a_budget_that_cannot_keep_the_in_flight_activations(make_cfg, capsys):
    """The dry run plans rank 0 under ONE_F_ONE_B's budget with its in-flight activations checkpointed (or
    spilled); kept on the device, as the plan that cannot checkpoint would keep them, they do not fit."""
    from stratum.cli import main
    sets = [a for o in [*ONE_F_ONE_B, PLAN] for a in ("--set", o)]
    base = ["train", "--dry-run", "--set", f"data.corpus={make_cfg().data.corpus!r}", "--set",
            f"data.cache_dir={make_cfg().data.cache_dir!r}", *sets]
    assert main(base) == 0
    out = capsys.readouterr().out
    rank0 = out.split("pipeline rank 0")[1].split("pipeline rank 1")[0]
    assert "does not fit" not in out and "up to 2 micro-batches in flight" in rank0
    assert "activations: recompute" in rank0 or "activations: offload" in rank0
    assert main([*base, "--set", "offload.activations='keep'"]) == 0
    rank0 = capsys.readouterr().out.split("pipeline rank 0")[1].split("pipeline rank 1")[0]
    assert "does not fit — offload: no placement fits" in rank0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipelined_offload_matches_plain(make_cfg, tmp_path):
    """1F1B over two ranks under a device budget (BUDGET) too small for rank 0's in-flight activations: rank 0
    keeps its blocks' inputs (recompute) or spills them to the host (offload), as its plan finds faster, and its
    chunks stream; gradients clipped, 10 steps. Rank 0's measured device peak stays under the budget (every
    rank's engine also asserts it after each block)."""
    common = [*ONE_F_ONE_B, "train.steps=10", "train.eval_interval=5"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), PLAN, "train.grad_accum=4", DROPOUT,
                   f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 2 and "device-resident chunks" in out
    assert "activations: recompute" in out or "activations: offload" in out
    _same_run(tmp_path / "po", tmp_path / "plain")
    assert 0 < max(r["offload_device_peak_bytes"] for r in read_metrics(tmp_path / "po")) <= BUDGET


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tie_to_another_rank_pinned_matches_plain(make_cfg, tmp_path):
    """An embedding (1024 × 128) larger than the chunks (64 Ki elements, the largest other parameter): each
    rank pins its holder of the tied tensor (BlockSeq.tied_elsewhere) instead of streaming it, sums it with
    the other rank's after the schedule, and the run equals the plain engine's."""
    common = ["train.steps=4", "train.eval_interval=2", "model.preset='mini'", "model.vocab_size=1024",
              "train.grad_accum=2", DROPOUT]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), "parallel.plan='pipeline(2, offload(device_budget=6MB))'",
                   *common, f"offload.chunk_size='{64 * 1024 * 4}B'", f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 2 and out.count("+ tied tensors pinned (512.00 KiB)") == 2
    _same_run(tmp_path / "po", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wave_over_offload_resumes_and_matches_plain(make_cfg, tmp_path):
    """The wave schedule puts the embedding and the head (one tied tensor) on rank 0; no clipping (chunks update
    inside the backward), AdamW's moments on disk, the in-flight micro-batches' block inputs spilled to the host
    (a budget that cannot keep their activations: 3.7 MB on rank 0); stopped after step 2 and resumed from the
    checkpoint."""
    common = [*COMMON, "optim.grad_clip=0.0"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    cfg = make_cfg(*common, out=tmp_path / "wave")
    extra = ["parallel.plan='pipeline(2, schedule=wave, offload(device_budget=3MB))'", "train.grad_accum=4",
             "optim.grad_clip=0.0", "offload.optimizer_tier='disk'", "offload.activations='offload'", DROPOUT,
             f"offload.disk_dir={str(tmp_path)!r}"]
    _stratum(cfg, *extra, stop_at=2)
    out = _stratum(cfg, *extra)
    assert "optimizer state on disk" in out and "resum" in out.lower()
    assert out.count("activations: offload (block inputs spilled to the host") == 2
    _same_run(tmp_path / "wave", tmp_path / "plain")
    rows = read_metrics(tmp_path / "wave")
    assert 0 < max(r["offload_device_peak_bytes"] for r in rows) <= 3_000_000


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("source", [
    # built whole (a factory's own initialisation cannot be replayed block by block): the ranks keep their stages
    ["model.source='sequential'", "model.factory='stratum.model.sequential:example_lm'"],
    # built block by block as the memory engine packs each rank's blocks (seeded per block)
    ["model.source='sequential'", "model.factory='stratum.model.sequential:example_lm_blocks'"],
], ids=["whole", "block-by-block"])
def test_pipelined_offload_of_an_nn_sequential_matches_plain(make_cfg, tmp_path, source):
    common = ["train.steps=6", "train.eval_interval=3", "train.grad_accum=2", *source]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), "parallel.plan='pipeline(2, offload(device_budget=2MB))'",
                   *common)
    assert out.count("offload plan:") == 2
    _same_run(tmp_path / "po", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("hf_config", ["gpt2"], indirect=True)
def test_pipelined_offload_of_transformers_gpt2_matches_plain(make_cfg, tmp_path, hf_config):  # noqa: F811
    """Built block by block on each rank: the head on rank 1 is tied to rank 0's embedding, whose values rank 1
    draws for the moment as its head's chunk is packed (model.placement.stage_block_init)."""
    common = ["train.steps=6", "train.eval_interval=3", "train.grad_accum=2", "model.source='hf'",
              f"model.hf_path={hf_config!r}"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), "parallel.plan='pipeline(2, offload(device_budget=2MB))'",
                   *common)
    assert out.count("offload plan:") == 2
    _same_run(tmp_path / "po", tmp_path / "plain")
