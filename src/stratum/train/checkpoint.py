"""Checkpoints: placement-independent training state, written atomically, refused when they do not fit.

Layout: ``<out_dir>/checkpoints/step_00000123/{state.safetensors, meta.json}`` and a ``latest`` file naming the
newest. A checkpoint directory is written under a temporary name and renamed into place, and ``latest`` is
replaced atomically afterwards, so a kill at any moment leaves the previous checkpoint usable.

Tensors (safetensors): ``param/<name>``, ``optim/<name>/<key>``, ``buffer/<name>`` (persistent buffers such as
running statistics; a checkpoint without them loads, and the model keeps its own), ``scaler/scale`` and
``scaler/growth_tracker`` (the fp16 loss scaler's; absent otherwise), ``rng/cpu``, ``rng/cuda<i>``.
``meta.json`` holds the step, the full config, the model fingerprint (parameter names and shapes), which a
resume compares against the current run, and the size and SHA-256 of ``state.safetensors``; the tensor file's
own header repeats the step. A load verifies all of it, and that the tensors are the model's (every parameter in
its shape, every AdamW moment beside it): a flipped bit, a truncated file, a hand-edited ``meta.json`` or a
rewritten tensor file is a one-line error naming the file, never a silently wrong resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from stratum.atomic import (
    WriteError,
    atomic_replace_dir,
    atomic_write_json,
    atomic_write_text,
    digest_mismatch,
    file_digest,
)
from stratum.config import Config, config_from_dict
from stratum.errors import StratumError
from stratum.runtime.engine import TrainState

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
"""Format 1 had no checksums: it loads with the structural checks only."""
STATE_FILE = "state.safetensors"
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

    if (bad := _first_non_finite(state.params)) is not None:
        raise StratumError(f"parameter {bad} holds NaN or inf after step {step}; this state is not saved (the last "
                           "good checkpoint stays): lower optim.lr or raise optim.warmup_fraction")
    root = Path(out_dir) / CKPT_DIR
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    tensors = {f"param/{n}": t.contiguous() for n, t in state.params.items()}
    for n, st in state.optim.items():
        tensors.update({f"optim/{n}/{k}": v.contiguous() for k, v in st.items()})
    tensors.update({f"buffer/{n}": t.contiguous() for n, t in state.buffers.items()})
    tensors.update({f"scaler/{k}": t.contiguous() for k, t in state.scaler.items()})
    tensors.update(_rng_state())
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / STATE_FILE), metadata={"step": str(step)})
        atomic_write_json(tmp / "meta.json", {
            "format_version": FORMAT_VERSION, "step": step, "config": cfg.to_dict(),
            "fingerprint": fingerprint, "fingerprint_hash": fingerprint_hash(fingerprint),
            "files": {STATE_FILE: file_digest(tmp / STATE_FILE)},
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


def _first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity; None when there is none."""
    return next((n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)


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
    """Read and verify a checkpoint directory; an unreadable or corrupt one is a one-line error naming the file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    meta = _read_meta(path)
    try:
        for name, want in meta.get("files", {}).items():
            if (why := digest_mismatch(path / name, want)) is not None:
                raise _corrupt(path / name, why)
        with safe_open(str(path / STATE_FILE), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise _corrupt(path / STATE_FILE, f"unreadable: {e}") from None
    if "step" in header and header["step"] != str(meta["step"]):
        raise _corrupt(path / "meta.json", f"it says step {meta['step']}, its tensors are of step {header['step']}")
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    buffers: dict[str, torch.Tensor] = {}
    scaler: dict[str, torch.Tensor] = {}
    rng: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        kind, _, rest = k.partition("/")
        if kind == "param":
            params[rest] = v
        elif kind == "optim":
            name, _, key = rest.rpartition("/")
            optim.setdefault(name, {})[key] = v
        elif kind == "buffer":
            buffers[rest] = v
        elif kind == "scaler":
            scaler[rest] = v
        else:
            rng[k] = v
    if "rng/cpu" not in rng:
        raise _corrupt(path / STATE_FILE, "it has no rng/cpu tensor")
    state = TrainState(params=params, optim=optim, buffers=buffers, scaler=scaler)
    return Checkpoint(path=path, step=meta["step"], meta=meta, state=state, rng=rng)


def _corrupt(file: Path, why: str) -> StratumError:
    return StratumError(f"checkpoint file {file} is corrupt ({why}); remove {file.parent} to resume from the "
                        "checkpoint before it, or start in a new train.out_dir")


def _read_meta(path: Path) -> dict:
    """``meta.json`` of checkpoint ``path``, its fields checked for type."""
    file = path / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: JSON nested too deeply)
        raise _corrupt(file, f"unreadable: {e}") from None
    if not isinstance(meta, dict):
        raise _corrupt(file, "not a JSON object")
    if meta.get("format_version") not in READABLE_FORMATS:
        raise StratumError(f"checkpoint {path} has format {meta.get('format_version')!r}, this Stratum reads "
                           f"{', '.join(map(str, READABLE_FORMATS))}; use the Stratum that wrote it")
    types = {"step": int, "config": dict, "fingerprint_hash": str, "files": dict}
    for key, kind in types.items():
        if (key in meta or key != "files") and not isinstance(meta.get(key), kind):
            raise _corrupt(file, f"its {key!r} is missing or not a {kind.__name__}")
    if meta["step"] < 0 or (meta["format_version"] >= 2 and STATE_FILE not in meta.get("files", {})):
        raise _corrupt(file, "its step is negative or the state file's checksum is missing")
    return meta


def check_tensors(ckpt: Checkpoint, fingerprint: dict) -> None:
    """Refuse tensors that are not the model's: a parameter missing, extra or of another shape, or an AdamW
    moment missing or of another shape than its parameter."""
    want = {n: list(s) for n, s in fingerprint["params"].items()}
    state = ckpt.state
    file = ckpt.path / STATE_FILE
    if missing := sorted(want.keys() - state.params.keys()):
        raise _corrupt(file, f"parameter {missing[0]} is missing")
    for name, t in state.params.items():
        if name not in want:
            raise _corrupt(file, f"it holds parameter {name}, which the model has not")
        if list(t.shape) != want[name]:
            raise _corrupt(file, f"parameter {name} has shape {list(t.shape)}, the model's is {want[name]}")
    keys = {k for st in state.optim.values() for k in st}
    for name, st in state.optim.items():  # a parameter that never had a gradient has no state: not checked
        if name not in want:
            raise _corrupt(file, f"it holds optimizer state of {name}, a parameter the model has not")
        if lacking := sorted(keys - st.keys()):
            raise _corrupt(file, f"optimizer tensor optim/{name}/{lacking[0]} is missing")
        for key, t in st.items():
            shape = want[name]
            if key != "step" and list(t.shape) != shape:
                raise _corrupt(file, f"optimizer tensor optim/{name}/{key} has shape {list(t.shape)}, "
                                     f"its parameter's is {shape}")


def check_compatible(ckpt: Checkpoint, cfg: Config, fingerprint: dict) -> list[str]:
    """Refuse a checkpoint of another model or data stream; return the harmless differences (for a warning)."""
    saved = ckpt.meta["config"]
    now = cfg.to_dict()
    refused: list[str] = []
    changed: list[str] = []
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
    check_tensors(ckpt, fingerprint)
    return changed
