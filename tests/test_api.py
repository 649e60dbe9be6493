"""The library API (``stratum.parallelize``): a user's own nn.Sequential with dropout trains on replicate(2) and
pipeline(2) (2 real gloo processes) exactly as on one process — the dropout masks come from (seed, step,
micro-batch, block) streams, not from each process's global generator — and again after ``close()`` in the same
processes. The workers are this file run as a script."""

from __future__ import annotations

import dataclasses
import json
import os
import re
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


class Skips(nn.Module):
    """A block with a branch the forward never takes: its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.used(x)


def _frozen_model() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(VOCAB, 16), Skips(), nn.LayerNorm(16), nn.Linear(16, VOCAB))
    m[0].weight.requires_grad_(False)
    return m


UNTOUCHED = ("blocks.0.weight", "blocks.1.unused.weight", "blocks.1.unused.bias")
"""The frozen embedding and the branch not taken: no gradient, so AdamW (weight decay included) skips them."""


def _frozen_run(plan: str) -> dict | None:
    """STEPS steps of the frozen model on ``plan``: its final parameters and the names AdamW holds state for
    (on the main process; None elsewhere)."""
    engine = stratum.parallelize(_frozen_model(), plan=plan, lr=3e-3, micro_batches=2, seed=7)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        engine.step(rows[:, :-1], rows[:, 1:])
    state = engine.state_dict()
    main = engine.is_main
    engine.close()
    return {"params": {k: v.tolist() for k, v in state.params.items()}, "optim": sorted(state.optim)} if main else None


def api_worker(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    if job.get("mismatch"):  # rank 1 builds a wider model than rank 0; then each cuts a batch of its own
        rank = int(os.environ["RANK"])
        model = nn.Sequential(nn.Embedding(VOCAB, 16 + 8 * rank), nn.Linear(16 + 8 * rank, VOCAB))
        with pytest.raises(StratumError) as e:
            stratum.parallelize(model, plan="replicate(2)", micro_batches=2)
        engine = stratum.parallelize(_model(), plan="replicate(2)", micro_batches=2)
        rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(rank))
        with pytest.raises(StratumError) as b:
            engine.step(rows[:, :-1], rows[:, 1:])
        Path(f"{job['out']}.{rank}").write_text(f"{e.value}\n{b.value}")
        return
    if job.get("frozen"):
        runs = {plan: _frozen_run(plan) for plan in job["plans"]}
        if runs[job["plans"][0]] is not None:
            Path(job["out"]).write_text(json.dumps(runs))
        return
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


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_frozen_and_unreached_parameters_stay_as_plain_leaves_them(tmp_path):
    """A frozen parameter and one the forward never reaches: the replicated plans leave both as the plain engine
    does (unchanged, no AdamW state), and the mean reduction trains the rest as plain does."""
    want = _frozen_run("local")
    assert want is not None
    job = tmp_path / "job.json"
    plans = ["replicate(2)", "replicate(2, reduce=adasum)"]
    job.write_text(json.dumps({"frozen": True, "plans": plans, "out": str(tmp_path / "got.json")}))
    run_workers(__file__, job, 2, timeout=180)
    got = json.loads((tmp_path / "got.json").read_text())
    first = {k: torch.tensor(v) for k, v in want["params"].items()}
    initial = dict(_frozen_model().named_parameters())
    for name in UNTOUCHED:
        assert torch.equal(first[name], initial[name.removeprefix("blocks.")].detach())
        assert name not in want["optim"]
    for plan in plans:
        params = {k: torch.tensor(v) for k, v in got[plan]["params"].items()}
        assert got[plan]["optim"] == want["optim"], plan
        for name in UNTOUCHED:
            assert torch.equal(params[name], first[name]), (plan, name)
        if plan == "replicate(2)":
            for name, t in first.items():
                torch.testing.assert_close(params[name], t, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_processes_that_built_different_models_or_batches_are_refused_by_name(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"mismatch": True, "out": str(tmp_path / "err")}))
    run_workers(__file__, job, 2, timeout=120)
    for rank in (0, 1):
        model, batch = (tmp_path / f"err.{rank}").read_text().splitlines()
        assert model.startswith(f"the ranks differ in the model built: rank(s) {rank} have 3 tensors")
        assert batch.startswith(f"the ranks differ in the first step's batch: rank(s) {rank} have (8, 16) and "
                                "(8, 16) (values ")
        assert batch.endswith("give every process the same global batch (the plan shares it out)")


def test_an_offload_plan_for_a_model_of_other_inputs_is_one_line():
    conv = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.GELU(), nn.Flatten(), nn.Linear(96, 5))
    with pytest.raises(StratumError, match=r"^the offload leaf plans from the model's blocks run on token ids "
                                           r"\(\(4, 12\) int64.*block 0 \(0:Conv1d\) refused them"):
        stratum.parallelize(conv, plan="offload(device_budget=10MB)", micro_batches=2, batch_shape=(4, 12),
                            loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))


@pytest.mark.parametrize("kw, message", [({"micro_batches": 0}, "micro_batches must be ≥ 1"),
                                         ({"lr": float("nan")}, "lr must be > 0"),
                                         ({"betas": (2.0, 0.9)}, "betas[0] must be in [0, 1)"),
                                         ({"plan": "replicat(2)"}, "plan 'replicat(2)': 'replicat' is not a plan")])
def test_a_bad_argument_is_named_as_the_caller_wrote_it(kw, message):
    with pytest.raises(StratumError, match="^" + re.escape(message)):
        stratum.parallelize(_model(), **kw)


def test_a_state_of_another_shape_is_refused_by_name():
    engine = stratum.parallelize(_model(), micro_batches=2)
    state = engine.state_dict()
    wrong = dataclasses.replace(state, params={**state.params, "blocks.0.weight": torch.zeros(3, 16)})
    with pytest.raises(StratumError, match=r"^the training state's blocks.0.weight has shape \(3, 16\) where the "
                                           r"model's has \(64, 16\)"):
        engine.load_state_dict(wrong)
    engine.close()


def test_an_offload_plan_refuses_a_frozen_parameter_in_one_line():
    with pytest.raises(StratumError, match=r"^the offload leaf trains every parameter, and blocks.0.weight is frozen"):
        stratum.parallelize(_frozen_model(), plan="offload(device_budget=10MB)", micro_batches=2, batch_shape=(4, 12))


if __name__ == "__main__":
    api_worker(sys.argv[1])
