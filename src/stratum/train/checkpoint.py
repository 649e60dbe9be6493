"""Checkpoints: placement-independent training state, written atomically, refused when they do not fit.

Layout: ``<out_dir>/checkpoints/step_00000123/{state.safetensors, meta.json}`` and a ``latest`` file naming the
newest. A checkpoint directory is written under a temporary name and renamed into place, and ``latest`` is
replaced atomically afterwards, so a kill at any moment leaves the previous checkpoint usable.

Tensors (safetensors): ``param/<name>``, ``optim/<name>/<key>``, ``buffer/<name>`` (persistent buffers such as
running statistics; a checkpoint without them loads, and the model keeps its own), ``rng/cpu``, ``rng/cuda<i>``.
``meta.json`` holds the step, the full config and the model fingerprint (parameter names and shapes), which a
resume compares against the current run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from stratum.atomic import WriteError, atomic_replace_dir, atomic_write_json, atomic_write_text
from stratum.config import Config, config_from_dict
from stratum.errors import StratumError
from stratum.runtime.engine import TrainState

FORMAT_VERSION = 1
CKPT_DIR = "checkpoints"
# Fields whose change makes a resumed run a different run: refuse them. Others (steps, lr, intervals) may change.
_MUST_MATCH = {
    "model": None,  # every model field
    "data": ("corpus", "tokenizer", "bpe_vocab_size", "seq_len", "val_fraction"),
    "train": ("seed", "micro_batch_size"),
}
# grad_accum and the plan may change as long as the global batch (micro × accum × replicas) stays: a run saved
# under replicate(2) with grad_accum = 2 continues under a plain engine with grad_accum = 4.


@dataclass
class Checkpoint:
    path: Path
    step: int
    """Optimizer steps completed: the run continues with step ``step``."""
    meta: dict
    state: TrainState
    rng: dict[str, torch.Tensor]


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def _rng_state() -> dict[str, torch.Tensor]:
    rng = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"rng/cuda{i}"] = s
    return rng


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["rng/cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(rng) if k.startswith("rng/cuda")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def save_checkpoint(out_dir: Path, *, step: int, state: TrainState, cfg: Config, fingerprint: dict,
                    keep: int) -> Path:
    """Write the checkpoint after ``step`` completed steps; keep the ``keep`` newest. Returns its directory."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    root = Path(out_dir) / CKPT_DIR
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    tensors = {f"param/{n}": t.contiguous() for n, t in state.params.items()}
    for n, st in state.optim.items():
        tensors.update({f"optim/{n}/{k}": v.contiguous() for k, v in st.items()})
    tensors.update({f"buffer/{n}": t.contiguous() for n, t in state.buffers.items()})
    tensors.update(_rng_state())
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "state.safetensors"))
        atomic_write_json(tmp / "meta.json", {
            "format_version": FORMAT_VERSION, "step": step, "config": cfg.to_dict(),
            "fingerprint": fingerprint, "fingerprint_hash": fingerprint_hash(fingerprint),
        })
        atomic_replace_dir(tmp, final)
        atomic_write_text(root / "latest", final.name + "\n")
    except (OSError, SafetensorError, WriteError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = e.strerror if isinstance(e, OSError) else e.reason if isinstance(e, WriteError) else str(e)
        raise StratumError(f"cannot write checkpoint to {root} ({reason}); free disk space or change "
                           "train.out_dir, then run the same command to resume — the previous checkpoint is "
                           "untouched") from None
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_partial_writes(out_dir: Path) -> None:
    """Clear what a killed run left half-written in ``out_dir``: temp files of atomic writes and checkpoint
    directories not yet renamed into place; a checkpoint set aside for its replacement (``atomic_replace_dir``)
    goes back where the replacement never arrived. Only a run holding ``out_dir`` may call this: another live
    run's temp files would look the same."""
    root = Path(out_dir) / CKPT_DIR
    for aside in root.glob(".step_*.old"):
        final = root / aside.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)
    for tmp in root.glob(".tmp_step_*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for where in (Path(out_dir), root):
        for tmp in where.glob(".*.tmp"):
            if tmp.is_file():
                tmp.unlink(missing_ok=True)


def latest_checkpoint(out_dir: Path) -> Path | None:
    root = Path(out_dir) / CKPT_DIR
    latest = root / "latest"
    if latest.is_file():
        p = root / latest.read_text().strip()
        if p.is_dir():
            return p
    found = sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())
    return found[-1] if found else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint directory; an unreadable one is a one-line error naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        tensors = load_file(str(path / "state.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise StratumError(f"checkpoint {path} is unreadable ({e}); remove it to fall back to an older one, "
                           "or start in a new train.out_dir") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise StratumError(f"checkpoint {path} has format {meta.get('format_version')!r}, "
                           f"this Stratum reads {FORMAT_VERSION}")
    params, optim, buffers, rng = {}, {}, {}, {}
    for k, v in tensors.items():
        kind, _, rest = k.partition("/")
        if kind == "param":
            params[rest] = v
        elif kind == "optim":
            name, _, key = rest.rpartition("/")
            optim.setdefault(name, {})[key] = v
        elif kind == "buffer":
            buffers[rest] = v
        else:
            rng[k] = v
    state = TrainState(params=params, optim=optim, buffers=buffers)
    return Checkpoint(path=path, step=int(meta["step"]), meta=meta, state=state, rng=rng)


def check_compatible(ckpt: Checkpoint, cfg: Config, fingerprint: dict) -> list[str]:
    """Refuse a checkpoint of another model or data stream; return the harmless differences (for a warning)."""
    saved = ckpt.meta["config"]
    now = cfg.to_dict()
    refused, changed = [], []
    for section, values in now.items():
        for key, value in values.items():
            old = saved.get(section, {}).get(key)
            if old == value:
                continue
            must = _MUST_MATCH.get(section, ())
            (refused if must is None or key in must else changed).append(f"{section}.{key}: {old!r} → {value!r}")
    before = config_from_dict(saved)
    if before.global_batch != cfg.global_batch:
        refused.append(f"global batch (micro × accum × replicas): {before.global_batch} → {cfg.global_batch}")
    if refused:
        raise StratumError(f"checkpoint {ckpt.path} is from a different model/data setup ({'; '.join(refused)}); "
                           "use the original settings or a new train.out_dir")
    if fingerprint_hash(fingerprint) != ckpt.meta.get("fingerprint_hash"):
        raise StratumError(f"checkpoint {ckpt.path} holds a different model architecture than the one configured "
                           "(parameter names or shapes differ); use a new train.out_dir")
    return changed
