"""The replicate node: ZeRO-2's layout, micro-batch shares and speeds, and parity of replicated plans with the
plain engine on the same global batch — real gloo processes through ``stratum train`` (reductions: test_parallel_reduce.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_in_process import run_main

from stratum.dist.world import World
from stratum.errors import StratumError
from stratum.ir.plan import parse_plan
from stratum.parallel.replicate import even_shares, speed_shares
from stratum.parallel.shard import ShardedAdamW
from stratum.runtime.engine import OptimSpec
from stratum.train.checkpoint import latest_checkpoint, load_checkpoint
from stratum.train.trainer import read_metrics, train

SPEC = OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def test_micro_batch_shares_follow_speeds_and_sum_to_the_step():
    assert even_shares(8, 3) == [3, 3, 2]
    assert speed_shares(8, [1.0, 1.0]) == [4, 4]
    assert speed_shares(8, [3.0, 1.0]) == [6, 2]
    assert speed_shares(5, [1.0, 0.01, 1.0]) == [2, 1, 2]  # everyone takes at least one
    assert sum(speed_shares(11, [2.5, 1.0, 0.7])) == 11
    with pytest.raises(StratumError, match="cannot give each of 3 replicas one"):
        speed_shares(2, [1.0, 1.0, 1.0])


def _fake_world(n: int, replica: int) -> World:
    """A replica's coordinates without a process group: enough to lay out its slice (no collective runs)."""
    plan = parse_plan(f"replicate({n})")
    return World(plan=plan, rank=replica, coord=plan.coord(replica), device=torch.device("cpu"), backend="gloo",
                 timeout_s=5.0, members={"replica": list(range(n)), "stage_rank": [replica], "split": [replica]})


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_state_is_one_nth_plus_at_most_one_tensor(n):
    from stratum.model.gpt import build_gpt
    model = build_gpt("tiny", vocab_size=256, seed=0)
    named = list(model.named_parameters())
    full = sum(p.numel() for _, p in named) * 8  # two fp32 moments per parameter (plain AdamW)
    largest = max(p.numel() for _, p in named) * 8
    total = 0
    for r in range(n):
        opt = ShardedAdamW([(k, torch.nn.Parameter(p.detach().clone())) for k, p in named], SPEC, _fake_world(n, r))
        assert opt.state_bytes() <= full / n + largest
        total += opt.state_bytes()
        covered = sum(x.length for x in opt.pieces)
        assert covered <= opt.shard_len
    assert full <= total < full + n * 8  # the slices tile the state (the last one padded)


def test_speeds_come_from_the_config_or_the_measurement(make_cfg, monkeypatch):
    from stratum.parallel.compose import rank_speeds, replica_speeds, stage_speeds

    cfg = make_cfg("parallel.plan='replicate(2, pipeline(2))'", "parallel.speeds='1,0.8,0.5,0.25'")
    world = _fake_world(2, 0)
    world.plan = cfg.plan
    speeds = rank_speeds(cfg, world)
    assert replica_speeds(speeds, cfg.plan) == [0.8, 0.25]  # a replica runs at its slowest process's speed
    assert stage_speeds(speeds, cfg.plan) == [0.5, 0.25]  # a pipeline rank at its slowest mirror's
    cfg.parallel.speeds = "auto"
    monkeypatch.setattr(World, "gather_floats", lambda self, v: [3.0, 2.0, 1.5, 6.0])
    assert replica_speeds(rank_speeds(cfg, world), cfg.plan) == [2.0, 1.5]
    cfg.parallel.speeds = ""
    assert rank_speeds(cfg, world) is None
    with pytest.raises(StratumError, match="must give 4 positive finite numbers"):
        make_cfg("parallel.plan='replicate(2, pipeline(2))'", "parallel.speeds='1,2'")


def test_auto_speeds_follow_the_replicas_measured_pace(monkeypatch):
    from stratum.model.gpt import build_gpt
    from stratum.parallel.replicate import ReplicateEngine
    from stratum.runtime.plain import PlainEngine

    plan = parse_plan("replicate(2, pipeline(2))")
    world = World(plan=plan, rank=0, coord=plan.coord(0), device=torch.device("cpu"), backend="gloo", timeout_s=5,
                  members={"replica": [0, 2], "stage_rank": [0, 1], "split": [0]})
    child = PlainEngine(build_gpt("tiny", vocab_size=256, seed=0), optim=SPEC, device=torch.device("cpu"))
    eng = ReplicateEngine(child, node=plan.replicate, world=world, speeds=[1.0, 1.0], rebalance=True)
    paces = iter([[0.1, 0.2, 0.4, 0.4], [0.1, 0.1, 0.4, 0.8], [0.2, 0.1, 0.4, 0.4], [0.1, 0.1, 0.4, 0.4]])
    monkeypatch.setattr(World, "gather_floats", lambda self, v: next(paces))
    eng._measure(0.0)  # replica 0 at its slowest rank's 0.2 s per micro-batch, replica 1 at 0.4 s
    assert eng.speeds == pytest.approx([5.0, 2.5]) and eng.share(12) == [8, 4]
    for _ in range(3):  # a median of the last three steps: one slow step moves nothing
        eng._measure(0.0)
    assert eng.speeds == pytest.approx([10.0, 2.5]) and eng.share(10) == [8, 2]


def test_a_faster_pipeline_rank_gets_more_blocks():
    from stratum.plan.partition import balanced_partition
    assert balanced_partition([1.0] * 8, 2) == [range(0, 4), range(4, 8)]
    assert balanced_partition([1.0] * 8, 2, [3.0, 1.0]) == [range(0, 6), range(6, 8)]


# ---- parity through `stratum train` ------------------------------------------------------------------------------
def _stratum(cfg, *extra: str, stop_at: int | None = None) -> str:
    """``stratum train`` with ``cfg``'s settings and ``extra`` overrides, run in this process (cli_in_process.py):
    what the launcher and its ranks printed; a non-zero exit fails with it."""
    d, t = cfg.data, cfg.train
    args = ["train"] + (["--stop-at", str(stop_at)] if stop_at else [])
    for o in [f"data.corpus={d.corpus!r}", f"data.cache_dir={d.cache_dir!r}", f"data.seq_len={d.seq_len}",
              f"model.preset={cfg.model.preset!r}", f"model.source={cfg.model.source!r}",
              f"model.hf_path={cfg.model.hf_path!r}", f"train.micro_batch_size={t.micro_batch_size}",
              f"train.steps={t.steps}", f"train.eval_interval={t.eval_interval}", f"train.eval_batches={t.eval_batches}",
              f"optim.warmup_steps={cfg.optim.warmup_steps}", f"optim.lr={cfg.optim.lr}",
              f"train.out_dir={t.out_dir!r}", *extra]:
        args += ["--set", o]
    code, out = run_main(args)
    assert code == 0, out
    return out


def _same_run(got_dir: Path, want_dir: Path, rel: float = 1e-5, *, param_atol: float = 1e-5,
              moment_atol: float = 1e-7) -> None:
    got, want = read_metrics(got_dir), read_metrics(want_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=rel), g["step"]
        if "eval_loss" in w:
            assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=rel)
    a = load_checkpoint(latest_checkpoint(got_dir)).state
    b = load_checkpoint(latest_checkpoint(want_dir)).state
    assert a.params.keys() == b.params.keys() and a.optim.keys() == b.optim.keys()
    # Adam's update is near lr·sign(g) where a gradient is tiny, so summation-order noise in such a gradient
    # moves its parameter by up to ~lr·1e-3: the absolute tolerance is set by that, the losses carry the oracle
    for k in b.params:
        torch.testing.assert_close(a.params[k], b.params[k], rtol=rel, atol=param_atol)
        torch.testing.assert_close(a.optim[k]["exp_avg"], b.optim[k]["exp_avg"], rtol=1e-3, atol=moment_atol)


# (plan, grad_accum): each replica takes grad_accum of the plain run's 4 micro-batches. Plans the dropout test
# below runs on the own GPT (replicate(2), replicate(2, pipeline(2))) and split(2) on GPT-2 (tests/
# test_parallel_split.py) are not repeated here: each CLI run costs its processes' start-up.
PLANS = {
    "gpt": [("replicate(2, shard=true)", 2), ("split(2)", 4), ("pipeline(2, split(2))", 4),
            ("replicate(2, pipeline(2, offload(device_budget=1.5MB)))", 2),
            ("replicate(2, shard=true, pipeline(2, offload(device_budget=1.5MB)))", 2)],
    "gpt2": [("replicate(2, pipeline(2))", 2), ("replicate(2, offload(device_budget=1MB))", 2),
             ("pipeline(2, offload(device_budget=1.2MB))", 4)],
    "llama": [("split(2)", 4)],
}


@pytest.fixture
def hf_config(tmp_path, request) -> str | None:
    if request.param is None:
        return None
    transformers = pytest.importorskip("transformers")
    special = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if request.param == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, **special)
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       **special)
    d = tmp_path / request.param
    cfg.save_pretrained(d)
    return str(d / "config.json")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("source, hf_config", [("gpt", None), ("gpt2", "gpt2"), ("llama", "llama")],
                         indirect=["hf_config"])
def test_parallel_plans_match_plain_on_the_same_global_batch(make_cfg, tmp_path, source, hf_config):
    model = ["model.source='hf'", f"model.hf_path={hf_config!r}"] if source != "gpt" else []
    common = ["train.steps=10", "train.eval_interval=5", *model]
    train(make_cfg(*common, "train.grad_accum=4", out=tmp_path / "plain"))
    for plan, accum in PLANS[source]:
        out = tmp_path / plan.replace(" ", "").replace("(", "_").replace(")", "").replace(",", "_")
        stdout = _stratum(make_cfg(*common, out=out), f"parallel.plan={plan!r}", f"train.grad_accum={accum}")
        assert stdout.count("done:") == 1
        _same_run(out, tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_plans_draw_the_plain_engines_dropout_masks(make_cfg, tmp_path):
    """With dropout every block draws from its (step, micro-batch, block) stream, so replicas and pipeline stages
    on other processes reproduce the plain engine's losses. (Not split: a split rank draws masks for its own
    heads only.)"""
    common = ["train.steps=6", "train.eval_interval=3", "model.dropout=0.1"]
    train(make_cfg(*common, "train.grad_accum=4", out=tmp_path / "plain"))
    for plan, accum in [("replicate(2)", 2), ("pipeline(2, schedule=zb-1f1b)", 4), ("replicate(2, pipeline(2))", 2)]:
        out = tmp_path / f"plan{accum}{len(plan)}"
        _stratum(make_cfg(*common, out=out), f"parallel.plan={plan!r}", f"train.grad_accum={accum}", "model.dropout=0.1")
        _same_run(out, tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unequal_shares_by_speed_keep_parity(make_cfg, tmp_path):
    """Speeds 1 : 0.34 give the replicas 6 and 2 of 8 micro-batches; the step still equals plain's."""
    common = ["train.steps=6", "train.eval_interval=3"]
    train(make_cfg(*common, "train.grad_accum=8", out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "fast_slow"), "parallel.plan='replicate(2)'",
                   "train.grad_accum=4", "parallel.speeds='1,0.34'")
    assert "replica speeds 1, 0.34" in out
    _same_run(tmp_path / "fast_slow", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_batchnorm_statistics_equal_plain_under_replicas(make_cfg, tmp_path):
    """A model with BatchNorm: each replica runs its share of the micro-batches, and the running statistics every
    replica ends with (so the eval losses and the checkpoint's buffers) are the plain engine's pass over all of
    them — with even shares, unequal ones (speeds 1 : 0.34 → 3 and 1 of 4), ZeRO-2, an offload leaf, and over
    pipelines (each stage's replicas combine their own layers), plain and offloaded."""
    common = ["train.steps=4", "train.eval_interval=2", "model.source='sequential'",
              "model.factory='stratum.model.sequential:batchnorm_lm_blocks'"]
    train(make_cfg(*common, "train.grad_accum=4", out=tmp_path / "plain"))
    want = load_checkpoint(latest_checkpoint(tmp_path / "plain")).state.buffers
    assert any(k.endswith("running_mean") for k in want)
    for k, (plan, extra) in enumerate([("replicate(2, shard=true)", []),
                                       ("replicate(2)", ["parallel.speeds='1,0.34'"]),
                                       ("replicate(2, offload(device_budget=1MB))", []),
                                       ("replicate(2, pipeline(2))", []),
                                       ("replicate(2, pipeline(2, offload(device_budget=1MB)))", [])]):
        out = tmp_path / f"bn{k}"
        _stratum(make_cfg(*common, out=out), f"parallel.plan={plan!r}", "train.grad_accum=2", *common[2:], *extra)
        _same_run(out, tmp_path / "plain", rel=1e-6)
        got = load_checkpoint(latest_checkpoint(out)).state.buffers
        assert got.keys() == want.keys()
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-7, msg=lambda m, n=name, p=plan: f"{p} {n}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_move_between_plans(make_cfg, tmp_path):
    """Saved under replicate(2, pipeline(2)), resumed under pipeline(4), then plain: the losses continue as the
    uninterrupted plain run's; saved under replicate(2, shard=true), resumed under the offload engine."""
    common = ["train.steps=6", "train.eval_interval=3"]
    train(make_cfg(*common, "train.grad_accum=4", out=tmp_path / "plain"))
    chain = make_cfg(*common, out=tmp_path / "chain")
    _stratum(chain, "parallel.plan='replicate(2, pipeline(2))'", "train.grad_accum=2", stop_at=2)
    _stratum(chain, "parallel.plan='pipeline(4)'", "train.grad_accum=4", stop_at=4)
    train(make_cfg(*common, "train.grad_accum=4", out=tmp_path / "chain"))
    _same_run(tmp_path / "chain", tmp_path / "plain")
    other = make_cfg(*common, out=tmp_path / "other")
    _stratum(other, "parallel.plan='replicate(2, shard=true)'", "train.grad_accum=2", stop_at=3)
    train(make_cfg(*common, "train.grad_accum=4", "parallel.plan='offload'", out=tmp_path / "other"))
    _same_run(tmp_path / "other", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adasum_trains_the_default_job(make_cfg, tmp_path):
    cfg = make_cfg("train.steps=30", "optim.lr=3e-3", out=tmp_path / "ada")
    _stratum(cfg, "parallel.plan='replicate(2, reduce=adasum)'", "train.grad_accum=2")
    losses = [r["loss"] for r in read_metrics(tmp_path / "ada")]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 0.5
