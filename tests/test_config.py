import dataclasses
import tomllib

import pytest

from stratum.config import SECTIONS, Config, describe, field_docs, load_config, parse_set, to_toml
from stratum.errors import StratumError
from stratum.sweep.spec import load_sweep


def test_defaults_validate_and_derived_values():
    cfg = load_config()
    cfg.validate()
    assert cfg.global_batch == cfg.train.micro_batch_size * cfg.train.grad_accum
    assert cfg.tokens_per_step == cfg.global_batch * cfg.data.seq_len
    assert f"{cfg.tokens_per_step:,}" in cfg.derived_summary()


def test_every_field_has_a_docstring():
    for cls in SECTIONS.values():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
    text = describe()
    assert "[train]" in text and "micro_batch_size = 16" in text


def test_toml_file_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[train]\nsteps = 7\ngrad_accum = 2\n[optim]\nlr = 1\n[data]\ncorpus = "x.txt"\n')
    cfg = load_config(p, ["train.steps=9", "model.preset=gpt2-124m", "data.corpus=123"])
    assert cfg.train.steps == 9 and cfg.train.grad_accum == 2
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.model.preset == "gpt2-124m"
    assert cfg.data.corpus == "123"  # a string field takes the text as written


def test_toml_round_trip():
    cfg = load_config(None, ["train.steps=3", "data.corpus='a \"b\"'"])
    p_cfg = Config()
    import tomllib
    doc = tomllib.loads(to_toml(cfg))
    assert doc["train"]["steps"] == 3 and doc["data"]["corpus"] == 'a "b"'
    assert set(doc) == set(dataclasses.asdict(p_cfg))


@pytest.mark.parametrize("overrides, message", [
    (["train.stepz=3"], "unknown key train.stepz (did you mean 'steps'?)"),
    (["trian.steps=3"], "unknown section [trian] (did you mean 'train'?)"),
    (["train.steps=abc"], "train.steps must be an integer"),
    (["train.steps=1.5"], "train.steps must be an integer"),
    (["train.resume=1"], "train.resume must be true or false"),
    (["optim.lr='fast'"], "optim.lr must be a float"),
    (["train.steps=0"], "train.steps must be ≥ 1"),
    (["optim.lr=-1"], "optim.lr must be > 0"),
    (["optim.min_lr=1"], "optim.min_lr must be in [0, optim.lr]"),
    (["model.dropout=1.0"], "model.dropout must be in [0, 1)"),
    (["model.preset=gpt5"], "model.preset = 'gpt5' is not one of"),
    (["model.source=onnx"], "model.source = 'onnx' is not one of"),
    (["model.source=hf"], "needs model.hf_path"),
    (["train.precision=fp8"], "train.precision = 'fp8' is not one of: fp32, bf16, fp16"),
    (["train.loss_scale=0.5"], "train.loss_scale must be ≥ 1"),
    # fp16's loss scaling lives in the plain and offload engines alone: every other plan is refused up front
    *[([f"parallel.plan='{plan}'", "train.precision=fp16"], f"not under plan '{plan}': use bf16 or fp32")
      for plan in ("replicate(2)", "pipeline(2, schedule=1f1b, partition=even)", "split(2)", "burst(2)",
                   "replicate(2, offload)")],
    (["train.engine=pipeline", "train.precision=fp16"], "runs on the plain and offload engines only"),
    (["parallel.plan=auto", "train.precision=fp16"], "searches multi-process plans"),
    (["train.engine=offload", "offload.optimizer_tier=device", "train.precision=fp16"],
     "fp16' on the offload engine keeps AdamW off the device"),
    (["train.engine=offload", "offload.delayed_update=true", "train.precision=fp16"],
     "offload.delayed_update runs with bf16 chunks"),
    (["train.device=tpu"], "train.device = 'tpu' is not"),
    (["data.val_fraction=0.9"], "data.val_fraction must be in [0, 0.5]"),
    (["data.val_fraction=0"], "leaves nothing to evaluate"),
    (["steps=3"], "must look like section.key=value"),
    (["train.engine=offload", "parallel.plan='replicate(2)'"], "both choose how to train: put the engine in the plan"),
    (["parallel.plan='replicate(2, offload(device_budget=abc))'"], "offload(device_budget=…) = 'abc' is not"),
    *[(["parallel.plan='replicate(2)'", f"parallel.speeds='{v}'"], "must give 2 positive finite numbers")
      for v in ("1,0", "1,nan", "inf,1", "1")],
])
def test_bad_overrides_are_one_line_errors(overrides, message):
    with pytest.raises(StratumError) as e:
        load_config(None, overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(StratumError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(StratumError, match="is a directory; give a .toml file"):
        load_config(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(StratumError, match="not valid TOML"):
        load_config(bad)
    flat = tmp_path / "flat.toml"
    flat.write_text("steps = 3\n")
    with pytest.raises(StratumError, match="must be a \\[section\\]"):
        load_config(flat)


def test_parse_set_values():
    assert parse_set("train.steps=5") == ("train", "steps", 5)
    assert parse_set("data.corpus=some/path.txt") == ("data", "corpus", "some/path.txt")
    assert parse_set("train.resume=false") == ("train", "resume", False)


def test_shipped_configs_load_and_default_matches_builtin():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "configs"
    files = sorted(root.glob("*.toml"))
    assert files
    for f in files:  # a sweep file (a [sweep] table over a training config) loads as a sweep
        if tomllib.loads(f.read_text()).get("sweep") is not None:
            load_sweep(f)
        else:
            load_config(f)
    assert load_config(root / "default.toml").to_dict() == load_config().to_dict()
