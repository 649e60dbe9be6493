"""Parity with dropout and module buffers, through the trainer: what a user runs.

The offload engine's set-up (bandwidth and AdamW probes, the lazy build, the start-up profile), its recomputed
forwards and the pipeline's shape probe must leave the RNG streams and the buffers (BatchNorm's running statistics)
as the plain engine has them, so that dropout masks and eval losses match; checkpoints carry the buffers, so a
resumed run's are the uninterrupted run's. Models: own GPT and a transformers GPT-2 with dropout 0.1, and an
``nn.Sequential`` with BatchNorm and dropout (a factory of this module).
"""

from __future__ import annotations

import pytest
import torch
from cli_in_process import run_main

from stratum.model.build import build_model
from stratum.model.sequential import batchnorm_lm_blocks
from stratum.train.checkpoint import latest_checkpoint, load_checkpoint
from stratum.train.trainer import read_metrics, train

STEPS = ["train.steps=4", "train.eval_interval=2", "train.grad_accum=2"]
BN = ["model.source='sequential'", "model.factory='stratum.model.sequential:batchnorm_lm_blocks'"]


def bn_dropout_blocks(*, vocab_size: int, seq_len: int):
    """The BatchNorm model with dropout 0.1 (``model.factory = "test_parity_dropout_buffers:bn_dropout_blocks"``)."""
    return batchnorm_lm_blocks(vocab_size=vocab_size, seq_len=seq_len, dropout=0.1)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    """One disk directory for every run: the disk bandwidth probe is measured once per directory and process."""
    return tmp_path_factory.mktemp("offload-disk")


@pytest.fixture(scope="module")
def hf_cfg_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("gpt2-dropout")
    transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64,
                            bos_token_id=1, eos_token_id=2).save_pretrained(d)
    return d


def _model_args(model: str, hf_dir) -> list[str]:
    if model == "gpt":
        return ["model.dropout=0.1"]
    if model == "hf":
        return ["model.source='hf'", f"model.hf_path={str(hf_dir)!r}", "model.dropout=0.1"]
    return ["model.source='sequential'", "model.factory='test_parity_dropout_buffers:bn_dropout_blocks'"]


def _state_bytes(cfg) -> int:
    """Bytes of parameters, gradients and AdamW moments: what the budgets below are fractions of."""
    meta = build_model(cfg.model, tokenizer_vocab=256, seq_len=cfg.data.seq_len, seed=0, device="meta")
    return 16 * meta.num_params()


# offload placements as config overrides, given a device budget D that streams the model's chunks
PLACEMENTS = {
    "no-budget": lambda D: [],
    "device-budget": lambda D: [f"offload.device_budget='{D}'"],
    "disk": lambda D: [f"offload.device_budget='{D}'", f"offload.host_budget='{D // 3}'",
                       "offload.optimizer_tier='disk'"],
    "recompute": lambda D: [f"offload.device_budget='{D}'", "offload.activations='recompute'"],
    "recompute-all-on-device": lambda D: ["offload.activations='recompute'"],
    "spill": lambda D: [f"offload.device_budget='{D}'", "offload.activations='offload'"],
}
# The transformers GPT-2 is too small to stream (its smallest device budget exceeds its training state): the
# direct-engine tests (test_offload_engine.py) stream it, with its config's dropout.
CASES = ([("gpt", "no-budget"), ("gpt", "recompute"), ("hf", "no-budget"), ("hf", "recompute-all-on-device")]
         + [("bn", p) for p in ("device-budget", "disk", "recompute", "spill")])
BUDGET = {"gpt": 0.7, "bn": 0.6}
"""Device budgets as fractions of the training state that stream these models' chunks (the tied embedding,
always on the device, is half of the tiny GPT)."""
_plain: dict = {}


def _reference(make_cfg, tmp_path_factory, model: str, hf_dir) -> list[dict]:
    if model not in _plain:
        out = tmp_path_factory.mktemp(f"plain-{model}")
        train(make_cfg(*STEPS, *_model_args(model, hf_dir), out=out))
        _plain[model] = (read_metrics(out), load_checkpoint(latest_checkpoint(out)).state.buffers)
    return _plain[model]


def _same(got: list[dict], want: list[dict], rel: float) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=rel, abs=0), (g["step"], g["loss"], w["loss"])
        assert ("eval_loss" in g) == ("eval_loss" in w)
        if "eval_loss" in w:
            assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=rel, abs=0), (g["step"], "eval")


def _same_buffers(got: dict, want: dict, rel: float) -> None:
    """Counts equal; statistics within ``rel`` in norm (‖got − want‖ ≤ rel ‖want‖: a running mean has entries
    near zero, where an element-wise relative bound measures only rounding)."""
    assert got.keys() == want.keys()
    for n, t in want.items():
        if not t.is_floating_point():
            assert torch.equal(got[n], t), n
            continue
        err = float(torch.linalg.vector_norm((got[n] - t).double()))
        assert err <= rel * float(torch.linalg.vector_norm(t.double())), (n, err)


@pytest.mark.parametrize("model,placement", CASES)
def test_offload_through_the_trainer_matches_plain(make_cfg, tmp_path, tmp_path_factory, disk_dir, request, model,
                                                   placement):
    """Losses, eval losses and final buffers of the offload engine equal the plain engine's (within 1e-6)."""
    hf_cfg_dir = request.getfixturevalue("hf_cfg_dir") if model == "hf" else None  # skips without transformers
    want, want_buffers = _reference(make_cfg, tmp_path_factory, model, hf_cfg_dir)
    cfg = make_cfg(*STEPS, *_model_args(model, hf_cfg_dir), out=tmp_path / "r")
    extra = PLACEMENTS[placement](int(BUDGET.get(model, 1.0) * _state_bytes(cfg)))
    train(make_cfg(*STEPS, *_model_args(model, hf_cfg_dir), "train.engine='offload'",
                   f"offload.disk_dir={str(disk_dir)!r}", *extra, out=tmp_path / "r"))
    _same(read_metrics(tmp_path / "r"), want, 1e-6)
    got_buffers = load_checkpoint(latest_checkpoint(tmp_path / "r")).state.buffers
    assert bool(got_buffers) == (model == "bn")
    _same_buffers(got_buffers, want_buffers, 1e-6)


def _stratum_train(cfg, *extra: str) -> tuple[int, str]:
    """``stratum train`` (it spawns the pipeline's ranks itself) for the fixture config ``cfg``, run in this process
    (cli_in_process.py): its exit code and what it printed."""
    d, t = cfg.data, cfg.train
    sets = [f"data.corpus={d.corpus!r}", f"data.cache_dir={d.cache_dir!r}", f"data.seq_len={d.seq_len}",
            f"model.preset={cfg.model.preset!r}",
            f"train.micro_batch_size={t.micro_batch_size}", f"train.steps={t.steps}",
            f"train.eval_interval={t.eval_interval}", f"train.eval_batches={t.eval_batches}",
            f"optim.warmup_steps={cfg.optim.warmup_steps}", f"optim.lr={cfg.optim.lr}",
            f"train.grad_accum={t.grad_accum}", f"train.out_dir={t.out_dir!r}", *BN, *extra]
    return run_main(["train"] + [a for s in sets for a in ("--set", s)])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipeline_keeps_buffers_like_plain_and_resumes_them(make_cfg, tmp_path):
    """Two gloo ranks (1F1B): the shape probe leaves the running statistics alone, the checkpoint gathers every
    rank's buffers, and a plain checkpoint's buffers resume on the ranks — losses, eval losses and buffers as the
    plain engine's (1e-5 relative)."""
    steps = ["train.steps=4", "train.eval_interval=2", "train.grad_accum=4"]
    pipe = ["train.engine='pipeline'", "pipeline.ranks=2", "pipeline.schedule='1f1b'"]
    train(make_cfg(*steps, *BN, out=tmp_path / "plain"))
    want = read_metrics(tmp_path / "plain")
    want_buffers = load_checkpoint(latest_checkpoint(tmp_path / "plain")).state.buffers
    assert want_buffers

    code, out = _stratum_train(make_cfg(*steps, *BN, out=tmp_path / "pipe"), *pipe)
    assert code == 0, out[-3000:]
    _same(read_metrics(tmp_path / "pipe"), want, 1e-5)
    _same_buffers(load_checkpoint(latest_checkpoint(tmp_path / "pipe")).state.buffers, want_buffers, 1e-5)

    mixed = make_cfg(*steps, *BN, out=tmp_path / "mixed")
    train(mixed, stop_at=2)
    code, out = _stratum_train(mixed, *pipe)
    assert code == 0, out[-3000:]
    _same(read_metrics(tmp_path / "mixed"), want, 1e-5)
    _same_buffers(load_checkpoint(latest_checkpoint(tmp_path / "mixed")).state.buffers, want_buffers, 1e-5)
