"""A trained model back from its checkpoint: the config it was trained under, the tokenizer, and the BlockSeq
with the checkpoint's parameters and buffers — what ``stratum sample`` and ``stratum export`` start from.

The checkpoint's ``meta.json`` holds the full config, so nothing but the path is needed: the model is rebuilt
from that config (an hf-source model from its ``model.hf_path``, which must still exist) and must have the
architecture the checkpoint's fingerprint records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stratum.config import Config, config_from_dict
from stratum.data.prepare import make_tokenizer
from stratum.data.tokenizer import Tokenizer, tokenizer_id
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.model.build import build_model
from stratum.model.neutral import load_buffers
from stratum.runtime.engine import TrainState
from stratum.runtime.optim import load_params
from stratum.train.checkpoint import CKPT_DIR, check_tokenizer, fingerprint_hash, latest_checkpoint, load_checkpoint


@dataclass
class Trained:
    """A model as a checkpoint left it, in eval mode on the CPU."""

    cfg: Config
    model: BlockSeq
    tokenizer: Tokenizer
    step: int
    """Optimizer steps the checkpoint had completed."""
    path: Path
    """The checkpoint directory."""


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: a checkpoint directory itself (holding ``meta.json``), or a run's
    out_dir (its latest checkpoint)."""
    p = Path(path).expanduser()
    if (p / "meta.json").is_file():
        return p
    if not p.is_dir():
        raise StratumError(f"{str(p)!r} {'is a file' if p.exists() else 'does not exist'}; give a run's out_dir "
                           f"(train.out_dir) or one of its {CKPT_DIR}/step_* directories")
    found = latest_checkpoint(p)
    if found is None and p.name == CKPT_DIR:  # the run's checkpoints directory: its latest, as for the run
        found = latest_checkpoint(p.parent)
    if found is None:
        raise StratumError(f"{str(p)!r} holds no checkpoint; give a run's out_dir after `stratum train` has "
                           f"saved one, or a {CKPT_DIR}/step_* directory")
    return found


def load_trained(path: str | Path) -> Trained:
    """Rebuild the model a checkpoint was trained as and load its state (see the module docstring)."""
    ckpt = load_checkpoint(find_checkpoint(path))
    try:
        cfg = config_from_dict(ckpt.meta["config"])
    except (KeyError, TypeError, AttributeError):
        raise StratumError(f"checkpoint {ckpt.path} has no readable config in meta.json; it was not written by "
                           "`stratum train`") from None
    try:
        cfg.validate()
    except StratumError as e:  # (a hand-edited meta.json: its model cannot be rebuilt)
        raise StratumError(f"checkpoint {ckpt.path}: meta.json's config is not valid ({e})") from None
    try:
        tokenizer = make_tokenizer(cfg)
    except StratumError as e:  # a BPE is found by its corpus: a moved corpus loses it
        raise StratumError(f"checkpoint {ckpt.path}: its {cfg.data.tokenizer} tokenizer cannot be rebuilt ({e})") from e
    check_tokenizer(ckpt, tokenizer_id(tokenizer))
    model = build_model(cfg.model, tokenizer_vocab=tokenizer.vocab_size, seq_len=cfg.data.seq_len,
                        seed=cfg.train.seed, device="cpu")
    if fingerprint_hash(model.fingerprint()) != ckpt.meta.get("fingerprint_hash"):
        raise StratumError(f"checkpoint {ckpt.path}: the model its config builds now is not the one it holds "
                           "(parameter names or shapes differ; was the model.hf_path directory or the "
                           "model.factory changed?)")
    load_state_into(model, ckpt.state)
    model.eval()
    return Trained(cfg=cfg, model=model, tokenizer=tokenizer, step=ckpt.step, path=ckpt.path)


def load_state_into(model: BlockSeq, state: TrainState) -> None:
    """Parameters and persistent buffers of ``state`` into ``model``, by canonical name."""
    with torch.no_grad():
        load_params(list(model.named_parameters()), state)
    load_buffers(model, state.buffers)
