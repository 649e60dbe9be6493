"""The pipeline engine for real: gloo processes reproduce the plain engine's losses and parameters.

Process start-up dominates on a small machine, so each parity test starts its P processes once and runs every
case (schedule kind × model) in sequence inside them; this file doubles as that worker
(``python tests/test_pipeline_engine.py JOB.json`` with RANK/WORLD_SIZE/MASTER_* set).
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

from stratum.errors import StratumError

V, T, MB, M, STEPS = 256, 16, 2, 4, 6  # each step runs a whole schedule: 6 show any drift from plain
DROPOUT = 0.1  # every block draws from its (micro-batch, block) stream, so ranks draw the plain engine's masks
KINDS = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"virtual": 2}), ("wave", {"waves": 1}),
         ("zb-1f1b", {}), ("zb-wave", {"waves": 1})]
# A user-written schedule: stage 0 mixes a full B with a split I/W; rank 1 splits its first backward.
CUSTOM = """name: custom-mixed
stages: 0 1
microbatches: 4
rank 0: F0.0 F0.1 B0.0 F0.2 I0.1 F0.3 B0.2 W0.1 I0.3 W0.3
rank 1: F1.0 I1.0 F1.1 B1.1 W1.0 F1.2 B1.2 F1.3 B1.3
"""


# ---- models and data shared by the worker and the reference -----------------------------------------------
def register_preset() -> None:
    from stratum.model.presets import PRESETS, GPTShape
    PRESETS.setdefault("pipe-test", GPTShape(n_layer=6, n_head=2, d_model=32, max_seq_len=64, vocab_size=None))


def build(model: str, hf_dir: str | None, seed: int = 11):
    if model == "gpt":
        register_preset()
        from stratum.model.gpt import build_gpt
        return build_gpt("pipe-test", vocab_size=V, seed=seed, dropout=DROPOUT)  # 8 blocks: embed, 6 layers, head
    from stratum.model.hf import build_hf
    return build_hf(hf_dir, seed=seed, dropout=DROPOUT)


def batches(step: int):
    from stratum.data.tokens import Batch
    g = torch.Generator().manual_seed(1000 + step)
    # a learnable stream: token t+1 = (token t + small step) mod V, with noise
    start = torch.randint(0, V, (MB * M, 1), generator=g)
    inc = torch.randint(1, 4, (MB * M, T + 1), generator=g).cumsum(1)
    data = (start + inc) % V
    return [Batch(x=data[i * MB:(i + 1) * MB, :-1], y=data[i * MB:(i + 1) * MB, 1:], stream=step * M + i)
            for i in range(M)]


def spec():
    from stratum.runtime.engine import OptimSpec
    return OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def lr_at(step: int) -> float:
    return 3e-3 * min(1.0, (step + 1) / 3)


def run_engine(engine, steps: int = STEPS):
    out = []
    for step in range(steps):
        r = engine.train_step(batches(step), lr_at(step))
        out.append((r.loss, r.grad_norm))
    out.append((engine.eval_loss(batches(99)), 0.0))
    return out


# ---- the worker -----------------------------------------------------------------------------------------------
def worker(job_path: str) -> None:
    import torch.distributed as dist

    from stratum.dist.launch import destroy_process_group
    from stratum.dist.world import join_world
    from stratum.ir.plan import parse_plan
    from stratum.plan.partition import even_partition
    from stratum.runtime.pipeline import PipelineEngine, PipelinePlan
    from stratum.schedule.generators import generate
    from stratum.schedule.textio import loads

    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    world = int(os.environ["WORLD_SIZE"])
    mesh = join_world(parse_plan(f"pipeline({world})"), torch.device("cpu"), backend="gloo", timeout_s=60)
    results = {}
    for case in job["cases"]:
        torch.manual_seed(0)
        if case["kind"] == "custom":
            sched = loads(CUSTOM)
        else:
            sched = generate(case["kind"], ranks=world, microbatches=M, **case["kw"])
        model = build(case["model"], job.get("hf_dir"))
        plan = PipelinePlan(schedule=sched, stages=even_partition(len(model), sched.num_stages))
        engine = PipelineEngine(model, plan=plan, optim=spec(), world=mesh)
        t0 = time.perf_counter()
        losses = run_engine(engine)
        wall = time.perf_counter() - t0
        state = engine.state()
        if dist.get_rank() == 0:
            results[case["name"]] = {"losses": losses, "params": state.params, "wall_s": wall,
                                     "exp_avg": {n: s["exp_avg"] for n, s in state.optim.items()}}
    if dist.get_rank() == 0:
        torch.save(results, job["out"])
    destroy_process_group()  # meets the peers first


def spawn_job(tmp_path: Path, world: int, cases: list[dict], hf_dir: str | None = None, timeout: float = 400):
    out = tmp_path / f"results_{world}.pt"
    job = tmp_path / f"job_{world}.json"
    job.write_text(json.dumps({"cases": cases, "out": str(out), "hf_dir": hf_dir}))
    run_workers(__file__, job, world, timeout)
    return torch.load(out)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2Config(n_layer=6, n_head=2, n_embd=32, vocab_size=V, n_positions=64, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2).save_pretrained(d)
    return str(d / "config.json")


@pytest.fixture(scope="module")
def references(hf_dir):
    """PlainEngine losses and final parameters per model (the schedule does not change what is computed)."""
    from stratum.runtime.plain import PlainEngine

    refs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and the workers use one too
    try:
        for model in ("gpt", "hf"):
            torch.manual_seed(0)
            eng = PlainEngine(build(model, hf_dir), optim=spec(), device=torch.device("cpu"))
            losses = run_engine(eng)
            st = eng.state()
            refs[model] = {"losses": losses, "params": st.params,
                           "exp_avg": {n: s["exp_avg"] for n, s in st.optim.items()}}
    finally:
        torch.set_num_threads(threads)
    return refs


def _check(res: dict, ref: dict, name: str) -> None:
    got = res["losses"]
    want = ref["losses"]
    assert len(got) == len(want)
    # the first step's loss, before any update: the same arithmetic, summed as plain sums it, to the bit (later
    # steps follow tied gradients summed across ranks in another order)
    assert got[0][0] == want[0][0], f"{name}: first loss {got[0][0]!r} vs plain {want[0][0]!r}"
    for k, ((lg, ng), (lw, nw)) in enumerate(zip(got, want)):
        assert abs(lg - lw) <= 1e-5 * abs(lw), f"{name}: loss at step {k}: {lg} vs plain {lw}"
        assert abs(ng - nw) <= 1e-4 * max(abs(nw), 1e-6), f"{name}: grad norm at step {k}: {ng} vs plain {nw}"
    assert res["params"].keys() == ref["params"].keys(), name
    for n, p in ref["params"].items():
        torch.testing.assert_close(res["params"][n], p, rtol=1e-4, atol=2e-5, msg=lambda m, n=n: f"{name} {n}: {m}")
    assert res["exp_avg"].keys() == ref["exp_avg"].keys(), name


def _cases(world: int) -> list[dict]:
    cases = [{"name": f"{model}/{kind}", "model": model, "kind": kind, "kw": kw}
             for kind, kw in KINDS for model in ("gpt", "hf")]
    if world == 2:
        cases.append({"name": "gpt/custom", "model": "gpt", "kind": "custom", "kw": {}})
    return cases


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_the_plain_engine(tmp_path, hf_dir, references, world):
    results = spawn_job(tmp_path, world, _cases(world), hf_dir)
    for case in _cases(world):
        _check(results[case["name"]], references[case["model"]], f"P={world} {case['name']}")


def test_one_rank_in_process_matches_plain(references, hf_dir):
    """pipeline(1) runs in this process without a process group: the runtime without messages."""
    from stratum.dist.world import single_world
    from stratum.ir.plan import parse_plan
    from stratum.runtime.pipeline import PipelineEngine, PipelinePlan
    from stratum.schedule.generators import generate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for kind in ("1f1b", "zb-1f1b"):
            model = build("gpt", None)
            sched = generate(kind, ranks=1, microbatches=M)
            eng = PipelineEngine(model, plan=PipelinePlan(schedule=sched, stages=[range(len(model))]),
                                 optim=spec(), world=single_world(parse_plan("pipeline(1)"), torch.device("cpu")))
            res = {"losses": run_engine(eng)}
            st = eng.state()
            res["params"] = st.params
            res["exp_avg"] = {n: s["exp_avg"] for n, s in st.optim.items()}
            _check(res, references["gpt"], f"P=1 {kind}")
    finally:
        torch.set_num_threads(threads)


def test_balanced_partition_minimises_the_heaviest_stage():
    from stratum.plan.partition import balanced_partition

    assert balanced_partition([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert balanced_partition([8, 1, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 7)]
    assert balanced_partition([1, 2, 3], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(StratumError, match="cannot cut"):
        balanced_partition([1, 2], 3)


def test_partition_from_a_profile_uses_the_dp_partitioner(make_cfg, tmp_path):
    """pipeline.partition = a Profile JSON: the cut comes from stratum.plan.partition on profiled time."""
    from stratum.parallel.compose import check_plan as check_pipeline

    f = _tiny_profile(make_cfg(), tmp_path, [0.1, 0.5, 0.1, 0.1])  # block 1 is 5x slower than the others
    plan = check_pipeline(make_cfg("train.engine='pipeline'", f"pipeline.partition={str(f)!r}"), tokenizer_vocab=256)
    assert plan.stages == [range(0, 2), range(2, 4)]
    plan3 = check_pipeline(make_cfg("train.engine='pipeline'", "pipeline.ranks=3", f"pipeline.partition={str(f)!r}"),
                           tokenizer_vocab=256)
    assert plan3.stages[1] == range(1, 2)  # the slow block alone
    with pytest.raises(StratumError, match="pipeline.partition"):
        make_cfg("pipeline.partition='magic'")


def test_a_profile_of_another_model_with_as_many_blocks_is_refused(make_cfg, tmp_path):
    from stratum.parallel.compose import check_plan

    f = _tiny_profile(make_cfg("model.vocab_size=512"), tmp_path, [0.1, 0.5, 0.1, 0.1])  # 4 blocks, wider embedding
    cfg = make_cfg("train.engine='pipeline'", f"pipeline.partition={str(f)!r}")
    with pytest.raises(StratumError, match=r"profile .*prof\.json is of another model \(its b0 has [\d,]+ "
                                           r"parameters, this model's block 0 [\d,]+\)") as e:
        check_plan(cfg, tokenizer_vocab=256)
    assert "\n" not in str(e.value)
    assert check_plan(make_cfg("train.engine='pipeline'", f"pipeline.partition={str(f)!r}", "model.vocab_size=512"),
                      tokenizer_vocab=256).stages == [range(0, 2), range(2, 4)]


def _tiny_profile(cfg, tmp_path, times: list[float]):
    """A profile with made-up times of ``cfg``'s model (its blocks' real parameter counts), saved to a file."""
    from stratum.model.build import build_model
    from stratum.profile.profile import BlockProfile, Profile

    meta = build_model(cfg.model, tokenizer_vocab=256, seq_len=cfg.data.seq_len, seed=0, device="meta")
    blocks = [BlockProfile(index=i, name=f"b{i}", kind="x", n_params=meta.owned_numel(i), param_bytes=4,
                           grad_bytes=4, optim_bytes=8, act_saved_bytes=4, out_bytes=4, fwd_s=t, bwd_s=2 * t,
                           bwd_input_s=t)
              for i, t in enumerate(times)]
    prof = Profile(model="tiny", device="cpu", dtype="float32", precision="fp32", micro_batch=4, seq_len=32,
                   runs=1, blocks=blocks)
    f = tmp_path / "prof.json"
    prof.save(f)
    return f


def test_local_model_holds_only_its_blocks(make_cfg):
    from stratum.model.placement import build_blocks
    from stratum.parallel.compose import check_plan

    cfg = make_cfg("train.engine='pipeline'", "pipeline.ranks=2", "train.grad_accum=2")
    full_names = None
    plan = check_plan(cfg, tokenizer_vocab=256)
    for rank in (0, 1):
        model = build_blocks(cfg.model, set(plan.blocks_of(rank)), tokenizer_vocab=256, seq_len=32, seed=5,
                             device=torch.device("cpu"))
        real = {n for n, p in model.named_parameters() if p.device.type != "meta"}
        blocks = {int(n.split(".")[1]) for n in real}
        assert blocks <= set(plan.blocks_of(rank)) | {0}  # block 0 only for the tied embedding
        full_names = full_names or set(dict(model.named_parameters()))
        assert set(dict(model.named_parameters())) == full_names  # same fingerprint on every rank
    # rank 1 holds the head, so it holds the tied embedding weight (but not the position embedding)
    assert "blocks.0.tok.weight" in real and "blocks.0.pos.weight" not in real


# ---- configuration errors, before any process starts -----------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["pipeline.ranks=8"], "needs 8 stages but the model has only 4 blocks"),
    (["pipeline.schedule='wave'", "pipeline.ranks=3"], "needs 6 stages but the model has only 4 blocks"),
    (["pipeline.schedule='interleaved'", "pipeline.ranks=2", "pipeline.virtual=3"], "needs 6 stages"),
    (["pipeline.schedule='zigzag'"], "neither a schedule kind"),
    (["pipeline.backend='nccl'", "train.device='cpu'"], "needs CUDA"),
])
def test_bad_pipeline_config_is_one_line_error_before_spawning(make_cfg, capsys, overrides, message):
    from stratum.cli import main

    cfg = make_cfg()  # fixtures' corpus/cache/out_dir
    args = ["train", "--set", f"data.corpus={cfg.data.corpus!r}", "--set", f"data.cache_dir={cfg.data.cache_dir!r}",
            "--set", "model.preset='tiny'", "--set", f"train.out_dir={cfg.train.out_dir!r}",
            "--set", "train.engine='pipeline'"]
    for o in overrides:
        args += ["--set", o]
    t0 = time.perf_counter()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stratum: error:") and message in err and "\n" not in err
    assert time.perf_counter() - t0 < 20
    assert not Path(cfg.train.out_dir).exists()  # nothing spawned, nothing written


@pytest.mark.parametrize("overrides, message", [
    (["pipeline.ranks=0"], "pipeline.ranks must be ≥ 1"),
    (["pipeline.partition='magic'"], "pipeline.partition"),
    (["pipeline.backend='mpi'"], "parallel.backend"),
    (["pipeline.timeout_s=0"], "parallel.timeout_s"),
    (["pipeline.nope=1"], "unknown key pipeline.nope"),
])
def test_bad_pipeline_keys(make_cfg, overrides, message):
    with pytest.raises(StratumError, match=message):
        make_cfg(*overrides)


def test_schedule_file_must_fit_the_run(make_cfg, tmp_path):
    from stratum.parallel.compose import check_plan as check_pipeline

    f = tmp_path / "s.txt"
    f.write_text(CUSTOM)
    plan = check_pipeline(make_cfg("train.engine='pipeline'", f"pipeline.schedule={str(f)!r}",
                                   "train.grad_accum=4"), tokenizer_vocab=256)
    assert plan.schedule.name == "custom-mixed"
    with pytest.raises(StratumError, match="train.grad_accum = 2"):
        check_pipeline(make_cfg("train.engine='pipeline'", f"pipeline.schedule={str(f)!r}", "train.grad_accum=2"),
                       tokenizer_vocab=256)
    with pytest.raises(StratumError, match="pipeline.ranks = 3"):
        check_pipeline(make_cfg("train.engine='pipeline'", f"pipeline.schedule={str(f)!r}", "train.grad_accum=4",
                                "pipeline.ranks=3"), tokenizer_vocab=256)


if __name__ == "__main__":
    worker(sys.argv[1])
