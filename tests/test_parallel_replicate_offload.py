"""The replicate node over the offload leaf: each chunk's gradient reduced over the replicas as it completes
reproduces the plain engine on the same global batch — real gloo processes through ``stratum train``."""

from __future__ import annotations

import pytest

from stratum.train.trainer import train
from test_parallel_replicate import _same_run, _stratum


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("clip, tier, budget", [
    (1.0, "auto", "25%"),  # clipped: the updates wait for the global norm
    # unclipped: each chunk updates inside the backward, after its reduction; AdamW's moments on the disk tier
    # (its staging needs a little more device room)
    (0.0, "disk", "30%"),
])
def test_replicated_offload_matches_plain_on_the_same_global_batch(make_cfg, tmp_path, clip, tier, budget):
    common = ["train.steps=4", "train.eval_interval=2", f"optim.grad_clip={clip}", "model.preset='mini'"]
    train(make_cfg(*common, "train.grad_accum=4", out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "rep"), f"parallel.plan='replicate(2, offload(device_budget={budget}))'",
                   "train.grad_accum=2", f"optim.grad_clip={clip}", f"offload.disk_dir={str(tmp_path)!r}",
                   f"offload.optimizer_tier={tier!r}")
    assert out.count("done:") == 1 and "replicate(2, offload" in out
    assert tier == "auto" or "optimizer state on disk" in out, out
    _same_run(tmp_path / "rep", tmp_path / "plain")
