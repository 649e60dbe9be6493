"""The library API (``stratum.parallelize``): a user's own nn.Sequential with dropout trains on replicate(2) and
pipeline(2) (2 real gloo processes) exactly as on one process — the dropout masks come from (seed, step,
micro-batch, block) streams, not from each process's global generator — and again after ``close()`` in the same
processes. The workers are this file run as a script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from gloo_workers import run_workers
from torch import nn

import stratum
from stratum.errors import StratumError

STEPS, ROWS, SEQ, VOCAB = 3, 8, 16, 64


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 16), *[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3),
                                                                 nn.Linear(32, 16)) for _ in range(3)],
                         nn.LayerNorm(16), nn.Linear(16, VOCAB))


def _losses(plan: str, micro_batches: int, seed: int = 7, out: Path | None = None) -> list[float]:
    """The losses of STEPS steps on ``plan`` (written to ``out`` by rank 0 where given)."""
    engine = stratum.parallelize(_model(), plan=plan, lr=3e-3, micro_batches=micro_batches, seed=seed)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        losses.append(engine.step(rows[:, :-1], rows[:, 1:]))
    assert engine.steps_done == STEPS
    if out is not None and engine.is_main:
        out.write_text(json.dumps(losses))
    engine.close()
    return losses


def api_worker(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    first = _losses(job["plan"], job["micro_batches"])
    # closed, a second model on the plan in the same process joins the same process group
    assert _losses(job["plan"], job["micro_batches"], out=Path(job["out"])) == first


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("plan, micro_batches", [("replicate(2)", 2), ("pipeline(2)", 4)])
def test_dropout_on_two_processes_draws_the_one_process_masks(tmp_path, plan, micro_batches):
    want = _losses("local", 4)  # the same 4 micro-batches of the step, as the plans cut it
    assert want != _losses("local", 4, seed=8), "other masks must give other losses for this test to mean anything"
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"plan": plan, "micro_batches": micro_batches, "out": str(tmp_path / "got.json")}))
    run_workers(__file__, job, 2, timeout=180)
    assert json.loads((tmp_path / "got.json").read_text()) == pytest.approx(want, rel=1e-6)


def test_an_offload_plan_for_a_model_of_other_inputs_is_one_line():
    conv = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.GELU(), nn.Flatten(), nn.Linear(96, 5))
    with pytest.raises(StratumError, match=r"^the offload leaf plans from the model's blocks run on token ids "
                                           r"\(\(4, 12\) int64.*block 0 \(0:Conv1d\) refused them"):
        stratum.parallelize(conv, plan="offload(device_budget=10MB)", micro_batches=2, batch_shape=(4, 12),
                            loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))


if __name__ == "__main__":
    api_worker(sys.argv[1])
