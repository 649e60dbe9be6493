"""split(n): tensor parallelism inside blocks — two gloo processes against the unsplit model on the same batches.

Process start-up dominates on a small machine, so one job of 2 processes runs every model in sequence, and each
rank also trains the unsplit model itself (the two ranks do so side by side on their own cores); this file
doubles as that worker (``python tests/test_parallel_split.py JOB.json`` with RANK/WORLD_SIZE/MASTER_* set).
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
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq, ModelInfo, lm_cross_entropy
from stratum.model.gpt import build_gpt
from stratum.parallel.split import check_split, split_blocks

V, T, B, STEPS, RESUMED = 256, 16, 4, 10, 2
CASES = ["gpt-tiny", "gpt-mini", "gpt2", "llama"]


# ---- models, data and the training loop shared by the worker and the unit tests ---------------------------
def hf_configs(d: Path) -> dict[str, str]:
    """Tiny GPT-2 and Llama (GQA: 4 heads, 2 KV heads) configs written to ``d``; nothing is downloaded."""
    import transformers
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfgs = {"gpt2": transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=64,
                                            **special),
            "llama": transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                              max_position_embeddings=64, **special)}
    for name, cfg in cfgs.items():
        cfg.save_pretrained(d / name)
    return {name: str(d / name / "config.json") for name in cfgs}


def build(case: str, hf_paths: dict[str, str], device: str = "cpu") -> BlockSeq:
    if case.startswith("gpt-"):
        return build_gpt(case[4:], vocab_size=V, seed=5, max_seq_len=64, device=device)
    from stratum.model.hf import build_hf
    return build_hf(hf_paths[case], seed=5, dropout=0.0, device=device)  # no dropout: parity needs none


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    # a learnable stream: token t+1 = (token t + small step) mod V
    data = (torch.randint(0, V, (B, 1), generator=g) + torch.randint(1, 4, (B, T + 1), generator=g).cumsum(1)) % V
    return data[:, :-1], data[:, 1:]


def spec():
    from stratum.runtime.engine import OptimSpec
    return OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.5)


def train(model: BlockSeq, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """The engines' step: loss, backward, clip by the global norm from grad_sq_norm, AdamW."""
    from stratum.runtime.engine import clip_coef
    from stratum.runtime.tensors import grad_sq_norm, scale_grads_

    params = list(model.parameters())
    losses = []
    for step in steps:
        loss = model.loss(*batch(step))
        loss.backward()
        coef = clip_coef(grad_sq_norm(params).sqrt().float(), spec().grad_clip)
        scale_grads_([p.grad for p in params], coef)
        for g in opt.param_groups:
            g["lr"] = 3e-3 * min(1.0, (step + 1) / 3)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


class CountAllReduces(TorchDispatchMode):
    """Counts the all-reduces DTensor issues (functional collectives) while active."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops._c10d_functional.all_reduce.default
        return func(*args, **(kwargs or {}))


# ---- the worker -----------------------------------------------------------------------------------------------
def run_case(case: str, hf_paths: dict[str, str], mesh) -> dict:
    """Everything rank 0 reports for one model: split and unsplit side by side, as full CPU tensors."""
    from torch.distributed.tensor import DTensor

    from stratum.parallel.split import apply_split
    from stratum.runtime.optim import make_adamw
    from stratum.runtime.optim import make_adamw as adamw_for
    from stratum.runtime.tensors import full_tensor, grad_sq_norm, load_full_, shard_state

    ref, model = build(case, hf_paths), build(case, hf_paths)
    apply_split(model, split_blocks(model), mesh)
    out: dict = {"names": [n for n, _ in model.named_parameters()],
                 "ref_names": [n for n, _ in ref.named_parameters()],
                 "sharded": {n: [list(p.to_local().shape), list(p.shape)] for n, p in model.named_parameters()
                             if isinstance(p, DTensor)}}
    # one forward/backward: loss, every full gradient, the global norm, the all-reduces it takes
    ref.loss(*batch(0)).backward()
    with CountAllReduces() as count:
        model.loss(*batch(0)).backward()
    out["all_reduces"], out["layers"] = count.n, len(split_blocks(model))
    out["grads"] = {n: full_tensor(p.grad) for n, p in model.named_parameters()}
    out["ref_grads"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
    out["sq"] = grad_sq_norm(list(model.parameters())).item()
    out["ref_norm"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
    # STEPS AdamW steps with clipping
    named, ref_named = list(model.named_parameters()), list(ref.named_parameters())
    cpu = torch.device("cpu")
    opt, ref_opt = adamw_for(named, spec(), cpu), make_adamw(ref_named, spec(), cpu)
    out["losses"], out["ref_losses"] = train(model, opt, range(STEPS)), train(ref, ref_opt, range(STEPS))
    out["params"] = {n: full_tensor(p) for n, p in named}
    out["exp_avg"] = {n: full_tensor(opt.state[p]["exp_avg"]) for n, p in named}
    out["ref_params"] = {n: p.detach().clone() for n, p in ref_named}
    out["ref_exp_avg"] = {n: ref_opt.state[p]["exp_avg"].clone() for n, p in ref_named}
    # the unsplit model's state loaded into a fresh split model, both trained on
    fresh = build(case, hf_paths)
    apply_split(fresh, split_blocks(fresh), mesh)
    fresh_named = list(fresh.named_parameters())
    fresh_opt = adamw_for(fresh_named, spec(), torch.device("cpu"))
    ref_state = {n: ref_opt.state[p] for n, p in ref_named}
    for n, p in fresh_named:
        load_full_(p, dict(ref_named)[n].detach())
        fresh_opt.state[p] = shard_state(ref_state[n], p)
    steps = range(STEPS, STEPS + RESUMED)
    out["resumed"], out["ref_resumed"] = train(fresh, fresh_opt, steps), train(ref, ref_opt, steps)
    return out


def dropout_spread(mesh) -> tuple[float, float]:
    """(largest difference between the ranks' outputs, largest difference from the output without dropout) of a
    split model training with dropout, every rank seeded alike: block outputs must stay replicated for the
    pipeline and the loss around them, so the ranks must draw the same residual dropout masks."""
    import torch.distributed as dist

    from stratum.parallel.split import apply_split

    model = build_gpt("tiny", vocab_size=V, seed=5, max_seq_len=64, dropout=0.2)
    apply_split(model, split_blocks(model), mesh)
    x = batch(0)[0]
    torch.manual_seed(7)
    with torch.no_grad():
        out, plain = model.train()(x), model.eval()(x)
    outs = [torch.empty_like(out) for _ in range(mesh.size())]
    dist.all_gather(outs, out, group=mesh.get_group())
    return max(float((o - out).abs().max()) for o in outs), float((out - plain).abs().max())


def worker(job_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from stratum.dist.launch import destroy_process_group, init_process_group

    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    init_process_group(world=int(os.environ["WORLD_SIZE"]), plan="test", backend="gloo", device=torch.device("cpu"),
                       timeout_s=60)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # as the engines build it
    results = {}
    for case in job["cases"]:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        results[case] = run_case(case, job["hf_paths"], mesh)
        results[case]["wall_s"] = time.perf_counter() - t0
    results["dropout"] = dropout_spread(mesh)
    if dist.get_rank() == 0:
        torch.save(results, job["out"])
    destroy_process_group()  # meets the peers first


def spawn_job(tmp_path: Path, cases: list[str], hf_paths: dict[str, str], world: int = 2,
              timeout: float = 100) -> dict:
    out, job = tmp_path / "results.pt", tmp_path / "job.json"
    job.write_text(json.dumps({"cases": cases, "out": str(out), "hf_paths": hf_paths}))
    run_workers(__file__, job, world, timeout)
    return torch.load(out)


# ---- parity over real processes -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_paths(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("transformers")
    return hf_configs(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def results(tmp_path_factory, hf_paths) -> dict:
    return spawn_job(tmp_path_factory.mktemp("split"), CASES, hf_paths)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * abs(b)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES)
def test_split_shards_the_layers_and_keeps_the_names(results, case):
    r = results[case]
    assert r["names"] == r["ref_names"]  # canonical names stay the BlockSeq's own
    sharded = r["sharded"]
    assert sharded and all(n.startswith("blocks.") for n in sharded)
    first, last = 0, max(int(n.split(".")[1]) for n in r["names"])
    assert not any(int(n.split(".")[1]) in (first, last) for n in sharded), "embedding and head stay plain"
    halves = [n for n, (local, full) in sharded.items() if local != full]
    assert halves and all(local[d] * 2 == full[d] for n in halves
                          for local, full in [sharded[n]] for d in range(len(full)) if local[d] != full[d])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES)
def test_split_gradients_and_norm_match_the_unsplit_model(results, case):
    r = results[case]
    assert r["grads"].keys() == r["ref_grads"].keys()
    for n, g in r["ref_grads"].items():
        assert rel(r["grads"][n], g) <= 1e-5, f"{case} {n}: gradient differs by {rel(r['grads'][n], g):.2e}"
    assert close(r["sq"], r["ref_norm"] ** 2, 1e-6), f"{case}: {r['sq']} vs clip_grad_norm_ {r['ref_norm'] ** 2}"
    # Megatron's minimum: one all-reduce after attention and one after the MLP, forward and backward
    assert r["all_reduces"] == 4 * r["layers"], f"{case}: {r['all_reduces']} all-reduces for {r['layers']} layers"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES)
def test_split_adamw_steps_match_the_unsplit_model(results, case):
    r = results[case]
    assert len(r["losses"]) == STEPS and r["ref_losses"][-1] < r["ref_losses"][0]  # it trains
    assert r["ref_norm"] > spec().grad_clip  # the first step is clipped: scale_grads_ is exercised
    for k, (a, b) in enumerate(zip(r["losses"], r["ref_losses"])):
        assert close(a, b, 1e-5), f"{case} step {k}: loss {a} vs unsplit {b}"
    # Parameters and AdamW state agree more loosely than losses: Adam's normalised step turns rounding-level
    # differences in near-zero gradient entries into steps of up to lr (the attention key bias's gradient is
    # zero up to rounding, since softmax ignores a constant per query), while a wrong shard is off by O(1).
    for n, p in r["ref_params"].items():
        assert rel(r["params"][n], p) <= 1e-3, f"{case} {n}: parameter differs by {rel(r['params'][n], p):.2e}"
        assert rel(r["exp_avg"][n], r["ref_exp_avg"][n]) <= 1e-3, f"{case} {n}: exp_avg differs"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES)
def test_unsplit_state_loads_into_a_split_model(results, case):
    r = results[case]
    assert len(r["resumed"]) == RESUMED
    for k, (a, b) in enumerate(zip(r["resumed"], r["ref_resumed"])):
        assert close(a, b, 1e-5), f"{case} resumed step {k}: loss {a} vs unsplit {b}"


@pytest.mark.timeout(150)
def test_split_ranks_seeded_alike_stay_replicated_under_dropout(results):
    between_ranks, from_no_dropout = results["dropout"]
    assert from_no_dropout > 0.0  # dropout is on
    assert between_ranks == 0.0


# ---- check_split without processes ------------------------------------------------------------------------
@pytest.mark.parametrize("case,n,message", [
    ("gpt-mini", 3, "split(3): block 1 (Layer) has 4 attention heads, not divisible by 3; "
                    "use a split size that divides 4"),
    ("gpt-tiny", 4, "split(4): block 1 (Layer) has 2 attention heads, not divisible by 4"),
    ("gpt2", 4, "split(4): block 1 (GPT2Block) has 2 attention heads, not divisible by 4"),
    ("llama", 4, "split(4): block 1 (LlamaDecoderLayer) has 2 KV heads, not divisible by 4; "
                 "use a split size that divides 2"),
])
def test_check_split_refuses_sizes_that_do_not_divide(hf_paths, case, n, message):
    model = build(case, hf_paths, device="meta")  # no memory: the check runs before any process starts
    with pytest.raises(StratumError) as e:
        check_split(model, n)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", CASES)
def test_check_split_accepts_a_size_that_divides(hf_paths, case):
    model = build(case, hf_paths, device="meta")
    check_split(model, 2)
    assert split_blocks(model) == list(range(1, len(model) - 1))


def test_check_split_refuses_mlp_width_that_does_not_divide(tmp_path):
    transformers = pytest.importorskip("transformers")
    from stratum.model.hf import build_hf
    transformers.LlamaConfig(hidden_size=32, intermediate_size=66, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=V).save_pretrained(tmp_path)
    with pytest.raises(StratumError, match=r"block 1 \(LlamaDecoderLayer\) has 66 MLP width, not divisible by 4"):
        check_split(build_hf(str(tmp_path), seed=0, device="meta"), 4)


def test_check_split_refuses_an_unknown_block_kind():
    blocks = [nn.Embedding(V, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Linear(8, V)]
    model = BlockSeq(blocks, lm_cross_entropy, ModelInfo(name="seq", vocab_size=V))
    with pytest.raises(StratumError, match=r"^split\(2\): block 0 \(Embedding\) is not a block kind split knows"):
        check_split(model, 2)
    assert split_blocks(model) == []


@pytest.mark.parametrize("case", CASES)
def test_check_split_refuses_a_model_that_drops_out(hf_paths, case):
    """A rank draws masks for its own heads, not its share of one process's: refused rather than run off parity
    (Llama's attention holds its probability as a float, GPT-2's in nn.Dropout, Stratum's GPT both ways)."""
    if case.startswith("gpt-"):
        model = build_gpt(case[4:], vocab_size=V, seed=5, max_seq_len=64, dropout=0.1, device="meta")
    else:
        from stratum.model.hf import build_hf
        model = build_hf(hf_paths[case], seed=5, dropout=0.1, device="meta")
    with pytest.raises(StratumError) as e:
        check_split(model, 2)
    assert "drops out (p = 0.1)" in str(e.value) and "set model.dropout = 0" in str(e.value)
    check_split(model, 1)  # one process draws the plain engine's masks
    check_split(model.eval(), 2)  # in eval mode no module draws masks


def test_check_split_refuses_a_zero_split():
    with pytest.raises(StratumError, match=r"split\(0\)"):
        check_split(build_gpt("tiny", vocab_size=V, seed=0, device="meta"), 0)


if __name__ == "__main__":
    worker(sys.argv[1])
