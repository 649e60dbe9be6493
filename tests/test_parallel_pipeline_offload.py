"""The pipeline node over the offload leaf: each rank's stages stream their chunks through its own tiers, and the
run reproduces the plain engine's losses and state — real gloo processes through ``stratum train``."""

from __future__ import annotations

import pytest

from stratum.train.trainer import train

from test_parallel_replicate import _same_run, _stratum

# one sequence per micro-batch: the activations of the micro-batches a stage holds at once fit beside a third of
# the stage's training state
COMMON = ["train.steps=4", "train.eval_interval=2", "model.preset='mini'", "train.micro_batch_size=1",
          "train.grad_accum=4"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipelined_offload_matches_plain(make_cfg, tmp_path):
    """1F1B over two ranks, each under a device budget of 25 % of its stages' state (chunks stream: sequences of
    16 tokens keep the in-flight activations beside it), gradients clipped, 10 steps."""
    common = [*COMMON, "data.seq_len=16", "train.steps=10", "train.eval_interval=5"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), "parallel.plan='pipeline(2, offload(device_budget=25%))'",
                   "train.grad_accum=4", f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 2 and "device-resident chunks" in out
    _same_run(tmp_path / "po", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wave_over_offload_resumes_and_matches_plain(make_cfg, tmp_path):
    """The wave schedule puts the embedding and the head (one tied tensor) on rank 0; no clipping (chunks update
    inside the backward), AdamW's moments on disk; stopped after step 2 and resumed from the checkpoint."""
    common = [*COMMON, "optim.grad_clip=0.0"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    cfg = make_cfg(*common, out=tmp_path / "wave")
    extra = ["parallel.plan='pipeline(2, schedule=wave, offload(device_budget=4.5MB))'", "train.grad_accum=4",
             "optim.grad_clip=0.0", "offload.optimizer_tier='disk'", f"offload.disk_dir={str(tmp_path)!r}"]
    _stratum(cfg, *extra, stop_at=2)
    out = _stratum(cfg, *extra)
    assert "optimizer state on disk" in out and "resum" in out.lower()
    _same_run(tmp_path / "wave", tmp_path / "plain")
