"""The replicate node over the offload leaf: each chunk's gradient reduced over the replicas as it completes,
beside the rest of the backward, reproduces the plain engine on the same global batch — real gloo processes
through ``stratum train``."""

from __future__ import annotations

import re

import pytest

from stratum.train.trainer import read_metrics, train

from test_parallel_replicate import _same_run, _stratum

COMMON = ["train.steps=4", "train.eval_interval=2", "model.preset='mini'"]


def _replicated(make_cfg, tmp_path, name: str, plan: str, *extra: str) -> str:
    out = _stratum(make_cfg(*COMMON, *extra, out=tmp_path / name), f"parallel.plan={plan!r}", "train.grad_accum=2",
                   f"offload.disk_dir={str(tmp_path)!r}", *extra)
    assert out.count("done:") == 1 and plan.split(",")[0] in out
    _same_run(tmp_path / name, tmp_path / "plain")
    # each chunk's reduction ran beside the backward of later blocks (launched, then waited for after them)
    assert all(r["reductions_overlapped"] >= 1 for r in read_metrics(tmp_path / name))
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_replicated_and_sharded_offload_match_plain(make_cfg, tmp_path):
    """Clipped (the updates wait for the global norm): replicas holding every chunk, then shard=true — each
    replica updating half of the chunks and holding their AdamW state only (≤ half + one chunk's)."""
    train(make_cfg(*COMMON, "train.grad_accum=4", out=tmp_path / "plain"))
    _replicated(make_cfg, tmp_path, "rep", "replicate(2, offload(device_budget=25%))")
    out = _replicated(make_cfg, tmp_path, "shard", "replicate(2, shard=true, offload(device_budget=25%))")
    full = read_metrics(tmp_path / "rep")[-1]["optim_state_bytes"]
    half = read_metrics(tmp_path / "shard")[-1]["optim_state_bytes"]
    kib = float(re.search(r"chunks of ([\d.]+) KiB", out).group(1))
    assert 0 < half <= full / 2 + 2 * kib * 1024  # AdamW's two moments of one chunk


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_unclipped_replicated_offload_with_moments_on_disk_matches_plain(make_cfg, tmp_path):
    """Each chunk updates inside the backward, right after its reduction; AdamW's moments on the disk tier (its
    staging needs a little more device room)."""
    extra = ["optim.grad_clip=0.0"]
    train(make_cfg(*COMMON, *extra, "train.grad_accum=4", out=tmp_path / "plain"))
    out = _replicated(make_cfg, tmp_path, "rep", "replicate(2, shard=true, offload(device_budget=30%))", *extra,
                      "offload.optimizer_tier='disk'")
    assert "optimizer state on disk" in out


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("shard", ["false", "true"])
def test_replicated_16_bit_chunks_match_the_memory_engines_own(make_cfg, tmp_path, shard):
    """bf16 with AdamW on the host: each replica's chunks are 16-bit working copies, the replicas reduce the fp32
    gradients their hosts accumulate, and two replicas of 2 micro-batches equal one memory engine of 4 (its
    16-bit chunks held to the plain engine's mixed-precision recipe in test_offload_mixed.py). Sharded, the
    global gradient norm must be one engine's bit for bit (reduce.gathered_norm): a sum of squares over the
    replicas' halves, a few fp32 ulps off, moved the third step's loss by 4.6e-5 through the 16-bit copies."""
    extra = ["train.precision='bf16'", "offload.optimizer_tier='host'"]
    train(make_cfg(*COMMON, *extra, "train.grad_accum=4", "parallel.plan='offload(device_budget=25%)'",
                   out=tmp_path / "plain"))
    out = _replicated(make_cfg, tmp_path, "rep", f"replicate(2, shard={shard}, offload(device_budget=25%))", *extra)
    assert out.count("16-bit working copies on the device") == 2
