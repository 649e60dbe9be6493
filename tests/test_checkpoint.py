"""Checkpoints: bit-exact resume, atomic writes, refusal of a checkpoint from another setup."""

import json
import logging
import os
import shutil
import statistics

import pytest
import torch
from safetensors.torch import load_file

from stratum.atomic import file_digest
from stratum.errors import StratumError
from stratum.train.checkpoint import latest_checkpoint
from stratum.train.trainer import read_metrics, train


def _final_params(out):
    """Every tensor of the run's latest checkpoint, from all its state files."""
    ckpt = latest_checkpoint(out)
    tensors = {}
    for name in json.loads((ckpt / "meta.json").read_text())["files"]:
        tensors.update(load_file(str(ckpt / name)))
    return tensors


BN = ("model.source='sequential'", "model.factory='stratum.model.sequential:batchnorm_lm_blocks'")


@pytest.mark.parametrize("extra", [(), ("model.dropout=0.1", "train.grad_accum=2"), (*BN, "train.grad_accum=2")])
def test_resume_is_bit_exact(make_cfg, tmp_path, extra):
    """N steps in one go == k steps, stop, resume, N−k steps: same losses, eval losses, weights and buffers (a
    BatchNorm model's running statistics, ``buffer/<name>``) to the last bit."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(make_cfg("train.steps=10", "train.eval_interval=5", *extra, out=straight))
    first = train(make_cfg("train.steps=10", "train.eval_interval=5", *extra, out=split), stop_at=4)
    assert first["steps_done"] == 4 and latest_checkpoint(split).name == "step_00000004"
    train(make_cfg("train.steps=10", "train.eval_interval=5", *extra, out=split))
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("eval_loss") for r in a] == [r.get("eval_loss") for r in b]
    pa, pb = _final_params(straight), _final_params(split)
    assert pa.keys() == pb.keys()
    assert any(k.startswith("buffer/") for k in pa) == (BN[0] in extra)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_fp16_skips_overflowing_steps_logs_the_scale_and_resumes_exactly(make_cfg, tmp_path):
    """train.precision = fp16 from a first loss scale so large that the tiny GPT's gradients overflow: those steps
    are skipped (not a failure: the run goes on), every record has the scale it ran with and whether it was
    skipped, the scale backs off and grows again, and a run stopped and resumed (the scaler's state in the
    checkpoint) logs the same losses, scales and skips as one run straight through."""
    args = ("train.precision='fp16'", "train.loss_scale=1048576", "train.loss_scale_growth_interval=2",
            "train.steps=12")
    train(make_cfg(*args, out=tmp_path / "a"))
    train(make_cfg(*args, out=tmp_path / "b"), stop_at=5)
    assert set(_final_params(tmp_path / "b")) >= {"scaler/scale", "scaler/growth_tracker"}
    train(make_cfg(*args, out=tmp_path / "b"))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [(r["loss"], r["loss_scale"], r["skipped"]) for r in a] == [(r["loss"], r["loss_scale"], r["skipped"])
                                                                       for r in b]
    skips, scales = [r["skipped"] for r in a], [r["loss_scale"] for r in a]
    assert skips[:3] == [1, 1, 1] and 0 in skips and max(scales[3:]) > scales[3]
    # strict JSON: a skipped step's non-finite gradient norm is null, every other step's a number
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    strict = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in lines]
    assert all((r["grad_norm"] is None) == bool(r["skipped"]) for r in strict)
    assert a[-1]["loss"] < a[0]["loss"] - 0.3


def test_bf16_offload_with_masters_and_moments_on_disk_resumes_exactly(make_cfg, tmp_path, capsys):
    """The offload engine on bf16 chunks with its fp32 masters and AdamW moments on disk (host budget too small for
    them), through ``train``: stopped and resumed, the losses and weights of one run straight through."""
    args = ("train.precision='bf16'", *OFFLOAD_ON_DISK)
    train(make_cfg(*args, out=tmp_path / "a"))
    out = capsys.readouterr().out
    assert "parameters' home disk; optimizer state on disk" in out and "fp32 masters on the disk" in out
    train(make_cfg(*args, out=tmp_path / "b"), stop_at=3)
    train(make_cfg(*args, out=tmp_path / "b"))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 6
    pa, pb = _final_params(tmp_path / "a"), _final_params(tmp_path / "b")
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


OFFLOAD_ON_DISK = ("train.engine='offload'", "offload.device_budget='1MB'", "offload.host_budget='1.2MB'",
                   "offload.activations='recompute'", "train.steps=6")


def test_a_checkpoint_in_several_files_is_written_a_chunk_at_a_time_and_resumes_exactly(make_cfg, tmp_path,
                                                                                        monkeypatch):
    """The offload engine hands the checkpoint its state a chunk at a time (state_parts), each file is written
    before the next chunk is read from its tier, and the files (here of about 64 KB) resume the run exactly."""
    from safetensors.torch import save_file

    import stratum.train.checkpoint as ck

    monkeypatch.setattr(ck, "FILE_BYTES", 64 << 10)
    written: list[int] = []

    def counting(tensors, path, metadata=None):
        written.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr("safetensors.torch.save_file", counting)
    args = (*OFFLOAD_ON_DISK, "offload.device_budget='1.5MB'")  # fp32 chunks
    train(make_cfg(*args, out=tmp_path / "a"))
    train(make_cfg(*args, out=tmp_path / "b"), stop_at=3)
    files = json.loads((latest_checkpoint(tmp_path / "b") / "meta.json").read_text())["files"]
    assert len(files) > 3 and list(files) == [f"state-{k:05d}.safetensors" for k in range(len(files))]
    chunk = max(written)  # a file holds what one part (a chunk) tipped over the limit
    assert chunk < sum(written) / 3
    train(make_cfg(*args, out=tmp_path / "b"))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 6
    pa, pb = _final_params(tmp_path / "a"), _final_params(tmp_path / "b")
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_a_checkpoint_of_format_2_resumes(make_cfg, tmp_path):
    """A checkpoint an earlier Stratum wrote (format 2: one state.safetensors) resumes as it did."""
    cfg = make_cfg("train.steps=4", out=tmp_path / "old")
    train(cfg, stop_at=2)
    ckpt = latest_checkpoint(tmp_path / "old")
    (ckpt / "state-00000.safetensors").rename(ckpt / "state.safetensors")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.update(format_version=2, files={"state.safetensors": file_digest(ckpt / "state.safetensors")})
    (ckpt / "meta.json").write_text(json.dumps(meta))
    train(make_cfg("train.steps=4", out=tmp_path / "new"))
    assert train(cfg)["steps_this_run"] == 2
    assert [r["loss"] for r in read_metrics(tmp_path / "old")] == [r["loss"] for r in read_metrics(tmp_path / "new")]


def test_resume_drops_metrics_of_a_killed_run_past_the_checkpoint(make_cfg, tmp_path):
    out = tmp_path / "r"
    train(make_cfg("train.steps=6", "train.ckpt_interval=3", "train.keep_checkpoints=5", out=out))
    # pretend the run died after step 6's metrics but before its checkpoint
    shutil.rmtree(out / "checkpoints" / "step_00000006")
    (out / "checkpoints" / "latest").write_text("step_00000003\n")
    train(make_cfg("train.steps=6", "train.ckpt_interval=3", out=out))
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_a_resumed_runs_summary_gives_its_own_steps_speed_and_the_whole_runs_losses(make_cfg, tmp_path):
    """Resumed under another engine, the summary's medians, peak and step time are the new engine's steps'."""
    out = tmp_path / "r"
    first = train(make_cfg("train.steps=8", out=out), stop_at=4)
    summary = train(make_cfg("train.steps=8", "train.engine='offload'", out=out))
    recs = read_metrics(out)
    later = [r for r in recs if r["step"] > 4]
    assert summary["first_loss"] == first["first_loss"] == recs[0]["loss"] and summary["engine"] == "offload"
    assert summary["median_tokens_per_s"] == statistics.median([r["tokens_per_s"] for r in later][1:])
    assert summary["peak_device_bytes"] == max(r["peak_device_bytes"] for r in later)
    assert summary["median_step_s"] == statistics.median([r["step_s"] for r in later][1:])


def test_completed_run_is_not_repeated(make_cfg, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="stratum")
    out = tmp_path / "r"
    s1 = train(make_cfg(out=out))
    s2 = train(make_cfg(out=out))
    assert "already complete" in caplog.text
    assert s2["final_loss"] == s1["final_loss"]
    extended = train(make_cfg("train.steps=10", out=out))  # raising steps continues the run
    assert extended["steps_done"] == 10 and len(read_metrics(out)) == 10


@pytest.mark.parametrize("change, message", [
    ("model.preset='mini'", "different model/data setup"),
    ("train.seed=7", "train.seed"),
    ("data.seq_len=16", "data.seq_len"),
    ("data.tokenizer='bpe'", r"data.tokenizer: 'byte' → 'bpe'"),
])
def test_checkpoint_from_another_setup_is_refused(make_cfg, tmp_path, change, message, monkeypatch):
    out = tmp_path / "r"
    train(make_cfg(out=out), stop_at=2)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    import stratum.train.trainer as trainer
    monkeypatch.setattr(trainer, "prepare_data", None)  # refused from the checkpoint's record: no BPE trained first
    with pytest.raises(StratumError, match=message):
        train(make_cfg(change, out=out))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing lost


def test_resume_false_with_checkpoints_is_refused(make_cfg, tmp_path):
    out = tmp_path / "r"
    train(make_cfg(out=out), stop_at=2)
    with pytest.raises(StratumError, match="already holds checkpoints"):
        train(make_cfg("train.resume=false", out=out))


def test_corrupt_checkpoint_is_a_clear_error(make_cfg, tmp_path):
    out = tmp_path / "r"
    train(make_cfg(out=out), stop_at=2)
    (latest_checkpoint(out) / "state-00000.safetensors").write_bytes(b"garbage")
    with pytest.raises(StratumError, match="state-00000.safetensors is corrupt"):
        train(make_cfg(out=out))


def test_keep_checkpoints_and_no_temp_leftovers(make_cfg, tmp_path):
    out = tmp_path / "r"
    train(make_cfg("train.steps=8", "train.ckpt_interval=2", "train.keep_checkpoints=2", out=out))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["latest", "step_00000006", "step_00000008"]


def test_every_file_a_run_writes_has_the_umasks_permissions(make_cfg, tmp_path):
    """Files written through a temp file (0o600) and safetensors' own (0o600) get what ``open`` would give: a
    team sharing a run directory can read its results and checkpoints."""
    out = tmp_path / "r"
    old = os.umask(0o027)
    try:
        train(make_cfg("train.steps=2", out=out))
    finally:
        os.umask(old)
    paths = [p for p in out.rglob("*")]
    assert any(p.suffix == ".safetensors" for p in paths) and any(p.name == "summary.json" for p in paths)
    for p in paths:
        assert p.stat().st_mode & 0o777 == (0o750 if p.is_dir() else 0o640), p


def test_a_stray_directory_does_not_count_towards_keep_checkpoints(make_cfg, tmp_path):
    out = tmp_path / "r"
    train(make_cfg("train.steps=6", "train.ckpt_interval=2", "train.keep_checkpoints=2", out=out), stop_at=4)
    (out / "checkpoints" / "step_00000009").mkdir()  # no meta.json: not a checkpoint
    train(make_cfg("train.steps=6", "train.ckpt_interval=2", "train.keep_checkpoints=2", out=out))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["latest", "step_00000004", "step_00000006", "step_00000009"]


@pytest.mark.parametrize("latest", ["", ".", "../x", "garbage"])
def test_a_latest_file_naming_no_checkpoint_falls_back_to_the_newest(make_cfg, tmp_path, latest):
    out = tmp_path / "r"
    train(make_cfg("train.steps=4", "train.ckpt_interval=2", "train.keep_checkpoints=5", out=out))
    (out / "checkpoints" / "latest").write_text(latest)
    assert latest_checkpoint(out) == out / "checkpoints" / "step_00000004"


def test_resuming_a_bpe_run_whose_corpus_changed_is_refused(make_cfg, corpus_file, tmp_path):
    """The changed corpus trains another BPE: the checkpoint's model would read other ids."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_file.read_text())
    bpe = [f"data.corpus={str(corpus)!r}", "data.tokenizer='bpe'", "data.bpe_vocab_size=300", "train.steps=4"]
    out = tmp_path / "r"
    train(make_cfg(*bpe, out=out), stop_at=2)
    with corpus.open("a") as f:
        f.write(" xylophone flarb wibble snork glorp" * 500)
    with pytest.raises(StratumError, match=r"was trained with tokenizer bpe:\w+, and its corpus now gives bpe:"):
        train(make_cfg(*bpe, out=out))


def test_interrupted_write_leaves_previous_checkpoint(make_cfg, tmp_path, monkeypatch):
    out = tmp_path / "r"
    train(make_cfg("train.steps=4", out=out), stop_at=2)
    import stratum.train.checkpoint as ck

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "atomic_replace_dir", boom)
    with pytest.raises(StratumError, match="previous checkpoint is untouched"):
        train(make_cfg("train.steps=4", out=out))
    assert latest_checkpoint(out).name == "step_00000002"
    assert not list((out / "checkpoints").glob(".tmp*"))


def test_a_checkpoint_without_buffers_loads_and_the_model_keeps_its_own(make_cfg, tmp_path):
    """A checkpoint written before buffers were saved resumes: the engine keeps the model's own statistics."""
    from safetensors.torch import save_file

    from stratum.model.build import build_model
    from stratum.model.neutral import persistent_buffers
    from stratum.runtime.engine import OptimSpec
    from stratum.runtime.plain import PlainEngine
    from stratum.train.checkpoint import load_checkpoint

    out = tmp_path / "r"
    cfg = make_cfg("train.steps=4", *BN, out=out)
    train(cfg, stop_at=2)
    path = latest_checkpoint(out) / "state-00000.safetensors"
    tensors = load_file(str(path))
    full = load_checkpoint(latest_checkpoint(out)).state
    save_file({k: v for k, v in tensors.items() if not k.startswith("buffer/")}, str(path))
    meta_path = path.with_name("meta.json")  # as its writer recorded the file
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "files": {path.name: file_digest(path)}}))
    old = load_checkpoint(latest_checkpoint(out)).state
    assert full.buffers and not old.buffers and old.params.keys() == full.params.keys()

    model = build_model(cfg.model, tokenizer_vocab=256, seq_len=32, seed=cfg.train.seed)
    own = {n: t.clone() for n, t in persistent_buffers(model).items()}
    engine = PlainEngine(model, optim=OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0),
                         device=torch.device("cpu"))
    engine.load_state(old)
    assert all(torch.equal(t, own[n]) for n, t in engine.state().buffers.items())
    engine.load_state(full)
    assert all(torch.equal(t, full.buffers[n]) for n, t in engine.state().buffers.items())
    assert train(cfg)["steps_done"] == 4  # the trainer resumes from it too


def test_a_resume_under_another_plan_notes_the_plans_not_the_keys_they_are_made_of(tmp_path):
    from stratum.config import config_from_dict
    from stratum.train.checkpoint import check_settings
    saved = config_from_dict({"train": {"engine": "pipeline"}, "pipeline": {"schedule": "interleaved"},
                              "offload": {"device_budget": "7MB"}, "optim": {"lr": 1e-3}}).to_dict()
    now = config_from_dict({"parallel": {"plan": "pipeline(2, offload(device_budget=7MB))"},
                            "optim": {"lr": 2e-3}})
    assert check_settings(tmp_path, saved, now) == [
        "plan: 'pipeline(2, schedule=interleaved, partition=even, virtual=2)' → "
        "'pipeline(2, schedule=1f1b, partition=even, offload(device_budget=7MB))'",
        "optim.lr: 0.001 → 0.002", "offload.device_budget: '7MB' → ''"]
    same_plan = config_from_dict({"train": {"engine": "pipeline"}, "pipeline": {"schedule": "interleaved"},
                                  "offload": {"device_budget": "7MB"}, "optim": {"lr": 2e-3}})
    assert check_settings(tmp_path, saved, same_plan) == ["optim.lr: 0.001 → 0.002"]
