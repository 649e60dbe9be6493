"""The library API (``stratum.parallelize``): a user's own nn.Sequential with dropout trains on replicate(2) and
pipeline(2) (2 real gloo processes) exactly as on one process — the dropout masks come from (seed, step,
micro-batch, block) streams, not from each process's global generator — and again after ``close()`` in the same
processes. The workers are this file run as a script."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

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
    if job.get("again"):  # closed, the model holds the trained values on every process: train it again
        Path(f"{job['out']}.{os.environ['RANK']}").write_text(json.dumps(_again(job["plans"])))
        return
    first = _losses(job["plan"], job["micro_batches"])
    # closed, a second model on the plan in the same process joins the same process group
    assert _losses(job["plan"], job["micro_batches"], out=Path(job["out"])) == first


def _again(plans: list[list]) -> dict:
    """The model trained STEPS steps on each of ``plans`` ([plan, micro-batches]) in turn (closed between), and
    after each close the model's values beside the state the engine gave: every process's copy is rank 0's."""
    model = _model()
    g = torch.Generator().manual_seed(0)
    out: dict = {"losses": [], "same": []}
    for plan, micro_batches in plans:
        engine = stratum.parallelize(model, plan=plan, lr=3e-3, micro_batches=micro_batches)
        for _ in range(STEPS):
            rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
            out["losses"].append(engine.step(rows[:, :-1], rows[:, 1:]))
        state = engine.state_dict()
        engine.close()
        mine = {f"blocks.{k}": v for k, v in model.state_dict().items()}
        out["same"].append(all(torch.equal(mine[k], v) for k, v in state.params.items()) if state.params else None)
        out.setdefault("values", []).append({k: v.tolist() for k, v in sorted(mine.items())})
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_closed_the_model_holds_the_trained_values_on_every_process_and_trains_again(tmp_path):
    """A pipeline leaves each process only its stages: close() gives every process's model rank 0's trained
    values back, so the same model trains on under another plan as if one plan had trained it all along."""
    plans = [["pipeline(2)", 4], ["replicate(2)", 2]]  # (4 micro-batches a step each, as the reference cuts)
    want = _again([["local", 4], ["local", 4]])
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"again": True, "plans": plans, "out": str(tmp_path / "got")}))
    run_workers(__file__, job, 2, timeout=180)
    got = [json.loads((tmp_path / f"got.{r}").read_text()) for r in (0, 1)]
    assert got[0]["same"][0] is True and got[0]["same"][1] is True  # rank 0: the model is the state
    assert got[0]["values"] == got[1]["values"]  # and every process's copy is rank 0's
    assert got[0]["losses"] == pytest.approx(want["losses"], rel=1e-5)


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
        assert model.startswith(f"the ranks differ in the model's tensor 0: rank(s) {rank} have blocks.0.weight "
                                f"({VOCAB}, {16 + 8 * rank}) torch.float32"), model
        assert batch.startswith(f"the ranks differ in the first step's batch: rank(s) {rank} have (8, 16) and "
                                "(8, 16) (values ")
        assert batch.endswith("give every process the same global batch (the plan shares it out)")
        assert model.endswith("build the same model on every process (its names, shapes and dtypes: the same code "
                              "and arguments)")


def test_an_offload_plan_for_a_model_of_other_inputs_is_one_line():
    conv = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.GELU(), nn.Flatten(), nn.Linear(96, 5))
    with pytest.raises(StratumError, match=r"^an offload leaf or a burst plan plans from the model's blocks run on "
                                           r"token ids \(\(4, 12\) int64.*block 0 \(0:Conv1d\) refused them"):
        stratum.parallelize(conv, plan="offload(device_budget=10MB)", micro_batches=2, batch_shape=(4, 12),
                            loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))


@pytest.mark.parametrize("kw, message", [({"micro_batches": 0}, "micro_batches must be ≥ 1"),
                                         ({"lr": float("nan")}, "lr must be > 0"),
                                         ({"betas": (2.0, 0.9)}, "betas[0] must be in [0, 1)"),
                                         ({"plan": "replicat(2)"}, "plan 'replicat(2)': 'replicat' is not a plan"),
                                         ({"plan": "Auto"}, "plan='auto' is `stratum train`'s")])
def test_a_bad_argument_is_named_as_the_caller_wrote_it(kw, message):
    with pytest.raises(StratumError, match="^" + re.escape(message)):
        stratum.parallelize(_model(), **kw)


def test_an_engine_refusal_names_the_arguments_too():
    """What the engine refuses once built (a budget no placement fits) names the plan's argument, not a key."""
    with pytest.raises(StratumError, match=r"^offload: no placement fits device_budget = 1KB and host_budget = "
                                           r"unlimited; the smallest device_budget that works"):
        stratum.parallelize(_model(), plan="offload(device_budget=1KB)", batch_shape=(4, 8))


def test_a_state_of_another_shape_is_refused_by_name():
    engine = stratum.parallelize(_model(), micro_batches=2)
    state = engine.state_dict()
    wrong = dataclasses.replace(state, params={**state.params, "blocks.0.weight": torch.zeros(3, 16)})
    with pytest.raises(StratumError, match=r"^the training state's blocks.0.weight has shape \(3, 16\) where the "
                                           r"model's has \(64, 16\)"):
        engine.load_state_dict(wrong)
    engine.close()


def test_a_16_bit_model_trains_on_from_an_fp32_state_and_the_offload_leaf_refuses_it():
    fp32 = _model()
    engine = stratum.parallelize(fp32, lr=3e-3)
    rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    engine.step(rows[:, :-1], rows[:, 1:])
    state = engine.state_dict()
    engine.close()
    half = _model().to(torch.bfloat16)
    engine = stratum.parallelize(half, lr=3e-3)
    engine.load_state_dict(state)  # (AdamW's moments taken in the parameters' dtype, as torch makes them)
    assert math.isfinite(engine.step(rows[:, :-1], rows[:, 1:]))
    engine.close()
    with pytest.raises(StratumError, match=r"^the offload leaf keeps fp32 master weights, and blocks.0.weight is "
                                           r"torch.bfloat16; give it the model in fp32"):
        stratum.parallelize(half, plan="offload(device_budget=10MB)", batch_shape=(4, 12))


def test_an_offload_plan_refuses_a_frozen_parameter_in_one_line():
    with pytest.raises(StratumError, match=r"^the offload leaf trains every parameter, and blocks.0.weight is frozen"):
        stratum.parallelize(_frozen_model(), plan="offload(device_budget=10MB)", micro_batches=2, batch_shape=(4, 12))


def test_a_streamed_offload_plan_gives_the_trained_model_back():
    """The memory engine streams the parameters through its chunks: closed, the model holds the trained values
    (not the chunks' stale views), on the device it was given on, and its state loads with torch.load's
    defaults."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 32))
    engine = stratum.parallelize(model, plan="offload(device_budget=20KB)", lr=1e-2, micro_batches=2,
                                 batch_shape=(4, 8))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        rows = torch.randint(0, 32, (8, 9), generator=g)
        engine.step(rows[:, :-1], rows[:, 1:])
    state = engine.state_dict()
    engine.close()
    for name, value in state.params.items():
        assert torch.equal(model.state_dict()[name.removeprefix("blocks.")], value), name
    assert model[1].weight.abs().sum() > 0 and model[1].weight.device.type == "cpu"
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf).params["blocks.1.weight"], state.params["blocks.1.weight"])


@pytest.mark.parametrize("budget", ["40KB", "80KB", "200KB"])
def test_an_offload_plan_of_a_small_model_is_chosen_among_ties_on_their_own_layouts(budget):
    """Near-tied placements are priced again on a slower disk, each on the layout it was priced on (one chunk
    size packs into several: a tier choice pins chunks); on another layout of its size, the slots of a placement
    could not hold one access (ValueError)."""
    torch.manual_seed(0)
    engine = stratum.parallelize(nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32)),
                                 plan=f"offload(device_budget={budget})", batch_shape=(4, 16))
    engine.close()


def test_a_closed_engine_refuses_to_go_on_and_leaves_the_model_given_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    engine = stratum.parallelize(model, plan="offload(device_budget=40KB)", batch_shape=(4, 16))
    rows = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(0))
    engine.step(rows[:, :-1], rows[:, 1:])
    engine.close()
    trained = model[1].weight.detach().clone()
    for call in (lambda: engine.step(rows[:, :-1], rows[:, 1:]), lambda: engine.eval_loss(rows[:, :-1], rows[:, 1:]),
                 engine.state_dict, engine.close):
        with pytest.raises(StratumError, match=r"^this engine is closed \(close\(\) gave the model back\)"):
            call()
    assert torch.equal(model[1].weight, trained) and trained.abs().sum() > 0


def test_a_model_an_open_engine_trains_is_refused_until_that_engine_closes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    first = stratum.parallelize(model, plan="local")
    for again in (model, nn.Sequential(nn.Embedding(32, 16), model[1])):  # (the model, or a layer of it, shared)
        with pytest.raises(StratumError, match=r"^the model's .*weight is being trained by an engine that is still "
                                               r"open: call that engine's close\(\) first"):
            stratum.parallelize(again, plan="local")
    first.close()
    dropped = stratum.parallelize(model, plan="local")
    del dropped  # (an engine let go of without close() holds the model no more)
    stratum.parallelize(model, plan="local").close()


def test_an_offload_leaf_refuses_micro_batches_larger_than_it_planned_for():
    torch.manual_seed(0)
    engine = stratum.parallelize(nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32)),
                                 plan="offload(device_budget=40KB)", batch_shape=(4, 16), micro_batches=2)
    g = torch.Generator().manual_seed(0)
    for shape in ((16, 17), (8, 65)):  # 8 rows a micro-batch; 64 tokens
        rows = torch.randint(0, 32, shape, generator=g)
        with pytest.raises(StratumError, match=r"^micro-batches of \(\d+, \d+\) are larger than the offload leaf "
                                               r"planned its device memory for \(batch_shape=\(4, 16\)\)"):
            engine.step(rows[:, :-1], rows[:, 1:])
    rows = torch.randint(0, 32, (8, 17), generator=g)
    assert engine.step(rows[:, :-1], rows[:, 1:]) > 0  # the engine goes on
    engine.close()


def _plain_losses(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn) -> list[float]:
    """STEPS steps of the caller's own loop: AdamW as parallelize's (betas 0.9, 0.95), no decay or clipping."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _stratum_losses(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn) -> tuple[list[float], Any]:
    engine = stratum.parallelize(model, lr=3e-3, weight_decay=0.0, grad_clip=0.0, loss_fn=loss_fn)
    losses = [engine.step(x, y) for _ in range(STEPS)]
    return losses, engine


def _shared() -> nn.Sequential:
    torch.manual_seed(0)
    act, block = nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    return nn.Sequential(nn.Linear(8, 32), act, block, act, block, nn.Linear(32, 1))


def test_a_module_placed_twice_runs_at_every_place():
    """nn.Sequential lists a module it holds twice once among its children; each place is a block (the shared
    module's parameters a tied group), and training equals the caller's own loop."""
    torch.manual_seed(1)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    want = _plain_losses(_shared(), x, y, nn.functional.mse_loss)
    got, engine = _stratum_losses(_shared(), x, y, nn.functional.mse_loss)
    assert len(engine.engine.model) == 6
    assert got == pytest.approx(want, rel=1e-6)
    engine.close()


def test_a_submodule_the_caller_put_in_eval_mode_stays_in_it():
    """A frozen BatchNorm in eval mode inside a training model (fine-tuning's habit): steps leave it there, as
    the caller's own loop does, and an evaluation gives every module its mode back."""
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 4))
        m[1].eval()
        m[1].requires_grad_(False)
        return m

    torch.manual_seed(1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    loss = nn.functional.cross_entropy
    mine = model()
    want = _plain_losses(mine, x, y, loss)
    theirs = model()
    got, engine = _stratum_losses(theirs, x, y, loss)
    assert got == pytest.approx(want, rel=1e-6)
    assert torch.equal(theirs[1].running_mean, torch.zeros(16))  # eval mode: the statistics never moved
    engine.eval_loss(x, y)
    assert theirs.training and theirs[0].training and not theirs[1].training
    engine.close()


def test_planning_from_the_blocks_keeps_the_callers_modes():
    """An offload leaf times the blocks before training (its planner's profile): in the modes the caller gave
    them, which it leaves as they were — a frozen BatchNorm neither trains nor moves its statistics."""
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Embedding(VOCAB, 32), nn.BatchNorm1d(SEQ), nn.Linear(32, VOCAB))
        m[1].eval()
        return m

    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    runs = {}
    for plan, extra in (("local", {}), ("offload", {"batch_shape": (ROWS, SEQ)})):
        m = model()
        engine = stratum.parallelize(m, plan=plan, lr=1e-2, **extra)
        assert not m[1].training
        runs[plan] = [engine.step(x, x) for _ in range(STEPS)]
        engine.close()
        assert not m[1].training and torch.equal(m[1].running_mean, torch.zeros(SEQ)), plan
    assert runs["offload"] == pytest.approx(runs["local"], rel=1e-6)


@pytest.mark.parametrize("lr", [-0.5, float("nan"), float("inf"), "0.1"])
def test_a_step_refuses_a_learning_rate_that_is_not_one(lr):
    engine = stratum.parallelize(_model())
    rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    with pytest.raises(StratumError, match=r"^step\(lr=.*\): the learning rate must be a finite number ≥ 0$"):
        engine.step(rows[:, :-1], rows[:, 1:], lr=lr)
    assert engine.steps_done == 0
    engine.close()


def test_loading_a_modules_state_dict_is_refused_in_one_line():
    engine = stratum.parallelize(_model())
    with pytest.raises(StratumError, match=r"^load_state_dict takes the TrainState that state_dict\(\) returns "
                                           r"\(got OrderedDict\); to start from a module's weights"):
        engine.load_state_dict(_model().state_dict())
    engine.close()


def test_a_burst_plan_to_plan_needs_the_batch_shape():
    with pytest.raises(StratumError, match=r"^plan 'burst\(2\)' plans its widths from the blocks timed on one "
                                           r"micro-batch: pass batch_shape"):
        stratum.parallelize(_model(), plan="burst(2)")


def test_a_model_without_values_is_refused_by_name():
    model = _model().to("meta")
    with pytest.raises(StratumError, match=r"^the model's blocks.0.weight is on the meta device"):
        stratum.parallelize(model)


if __name__ == "__main__":
    api_worker(sys.argv[1])
