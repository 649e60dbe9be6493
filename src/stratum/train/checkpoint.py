"""Checkpoints: placement-independent training state, written atomically, refused when they do not fit.

Layout: ``<out_dir>/checkpoints/step_00000123/{state-00000.safetensors, …, meta.json}`` and a ``latest`` file
naming the newest. A checkpoint directory is written under a temporary name and renamed into place, and
``latest`` is replaced atomically afterwards, so a kill at any moment leaves the previous checkpoint usable.

Tensors (safetensors): ``param/<name>``, ``optim/<name>/<key>``, ``buffer/<name>`` (persistent buffers such as
running statistics; a checkpoint without them loads, and the model keeps its own), ``scaler/scale`` and
``scaler/growth_tracker`` (the fp16 loss scaler's; absent otherwise), ``rng/cpu``, ``rng/cuda<i>``, in files of
about FILE_BYTES: an engine hands over its state in parts (:meth:`Engine.state_parts`; the memory engine a chunk
at a time, read from its tier), each written before the next is asked for, and a load reads a tensor from its
file only when the engine asks for it — so a model whose training state is larger than RAM is saved and resumed.
``meta.json`` holds the step, the full config, the model fingerprint (parameter names and shapes), which a
resume compares against the current run, and every state file's size and SHA-256; each file's own header
repeats the step. A load verifies all of it, and that the tensors are the model's (every parameter in its shape,
every AdamW moment beside it, from the files' headers): a flipped bit, a truncated file, a hand-edited
``meta.json`` or a rewritten tensor file is a one-line error naming the file, never a silently wrong resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from stratum.atomic import (
    WriteError,
    atomic_replace_dir,
    atomic_write_json,
    atomic_write_text,
    default_modes,
    digest_mismatch,
    file_digest,
)
from stratum.config import Config, config_from_dict
from stratum.errors import StratumError
from stratum.runtime.engine import Mapped, TrainState

FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
"""Format 1 had no checksums: it loads with the structural checks only; formats 1 and 2 hold one state file,
STATE_FILE."""
STATE_FILE = "state.safetensors"
STATE_FILES = "state-{:05d}.safetensors"
"""Format 3's state files, numbered from 0."""
FILE_BYTES = 256 << 20
"""About the tensor bytes of one state file: a checkpoint is written a file at a time, so a model larger than
RAM is saved with one file's tensors in memory (and resumed a tensor at a time: :func:`stored_tensors`)."""
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
    """Parameters and optimizer state read from the files when asked for (:func:`stored_tensors`)."""
    rng: dict[str, torch.Tensor]
    stored: dict[str, tuple[str, list[int]]]
    """Every tensor's key → the file holding it and its shape (from the files' headers)."""


def _read(file: Path, key: str) -> torch.Tensor:
    """Tensor ``key`` of one state file. The file is opened for the read and closed after it: safetensors maps
    the whole file, and a mapping held open would keep every page a resume touched resident."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(key)


def stored_tensors(where: dict[str, tuple[Path, str]]) -> Mapping[str, torch.Tensor]:
    """Tensors of a checkpoint by name (``where``: name → its state file and key there), each read from its file
    when asked for, anew each time: an engine restores a model larger than RAM a tensor at a time."""
    return Mapped(where, lambda _name, at: _read(*at))


def stored_optim(where: dict[str, dict[str, tuple[Path, str]]]) -> Mapping[str, Mapping[str, torch.Tensor]]:
    """A checkpoint's AdamW state by parameter name: that parameter's tensors, read when asked for."""
    return Mapped(where, lambda _name, keys: {k: _read(*at) for k, at in keys.items()})


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


def save_checkpoint(out_dir: Path, *, step: int, parts: Iterable[TrainState], cfg: Config, fingerprint: dict,
                    keep: int, tokenizer: str) -> Path:
    """Write the checkpoint after ``step`` completed steps from the state's ``parts`` (:meth:`Engine.state_parts`:
    each is written before the next is asked for), with the identity of the ``tokenizer`` it was trained with
    (:func:`~stratum.data.tokenizer.tokenizer_id`); keep the ``keep`` newest. Returns its directory."""
    from safetensors import SafetensorError

    root = Path(out_dir) / CKPT_DIR
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        files = _write_state_files(tmp, step, parts)
        atomic_write_json(tmp / "meta.json", {
            "format_version": FORMAT_VERSION, "step": step, "config": cfg.to_dict(),
            "fingerprint": fingerprint, "fingerprint_hash": fingerprint_hash(fingerprint), "files": files,
            "tokenizer": tokenizer,
        })
        default_modes(tmp)  # (safetensors writes its files 0o600)
        atomic_replace_dir(tmp, final)
        atomic_write_text(root / "latest", final.name + "\n")
    except StratumError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except (OSError, SafetensorError, WriteError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = e.strerror if isinstance(e, OSError) else e.reason if isinstance(e, WriteError) else str(e)
        raise StratumError(f"cannot write checkpoint to {root} ({reason}); free disk space or change "
                           "train.out_dir, then run the same command to resume — the previous checkpoint is "
                           "untouched") from None
    # only whole checkpoints count towards keep: a directory without meta.json (a stray copy, a hand-made one) is
    # no checkpoint, and counting it would remove one that is
    for old in sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_state_files(tmp: Path, step: int, parts: Iterable[TrainState]) -> dict[str, dict]:
    """The parts' tensors in files of about FILE_BYTES each (the RNG states in the first), every file's header
    holding the step; their names → size and SHA-256."""
    from safetensors.torch import save_file

    files: dict[str, dict] = {}
    group: dict[str, torch.Tensor] = dict(_rng_state())
    size = 0

    def flush() -> None:
        name = STATE_FILES.format(len(files))
        save_file(group, str(tmp / name), metadata={"step": str(step)})
        files[name] = file_digest(tmp / name)

    for part in parts:
        if (bad := _first_non_finite(part.params)) is not None:
            raise StratumError(f"parameter {bad} holds NaN or inf after step {step}; this state is not saved (the "
                               "last good checkpoint stays): lower optim.lr or raise optim.warmup_fraction")
        for key, t in _tensors(part).items():
            group[key] = t
            size += t.numel() * t.element_size()
        if size >= FILE_BYTES:
            flush()
            group, size = {}, 0
    if group or not files:
        flush()
    return files


def _tensors(state: TrainState) -> dict[str, torch.Tensor]:
    """``state``'s tensors under their checkpoint keys (see the module docstring)."""
    tensors = {f"param/{n}": t.contiguous() for n, t in state.params.items()}
    for n, st in state.optim.items():
        tensors.update({f"optim/{n}/{k}": v.contiguous() for k, v in st.items()})
    tensors.update({f"buffer/{n}": t.contiguous() for n, t in state.buffers.items()})
    tensors.update({f"scaler/{k}": t.contiguous() for k, t in state.scaler.items()})
    return tensors


def _first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
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
    if latest.is_file():  # (a name that is no checkpoint's — empty, edited — falls back to the newest one)
        name = latest.read_text().strip()
        if name.startswith("step_") and "/" not in name and (root / name).is_dir():
            return root / name
    found = sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())
    return found[-1] if found else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Open and verify a checkpoint directory (its parameters and optimizer state are read when the state is
    asked for them); an unreadable or corrupt one is a one-line error naming the file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    meta = _read_meta(path)
    where: dict[str, tuple[Path, str]] = {}
    stored: dict[str, tuple[str, list[int]]] = {}
    for name in meta.get("files") or [STATE_FILE]:
        file = path / name
        try:
            if (why := digest_mismatch(file, meta["files"][name]) if "files" in meta else None) is not None:
                raise _corrupt(file, why)
            with safe_open(str(file), framework="pt") as f:
                header = f.metadata() or {}
                for key in f.keys():
                    where[key] = (file, key)
                    stored[key] = (name, list(f.get_slice(key).get_shape()))
        except (OSError, SafetensorError) as e:
            raise _corrupt(file, f"unreadable: {e}") from None
        if "step" in header and header["step"] != str(meta["step"]):
            raise _corrupt(path / "meta.json", f"it says step {meta['step']}, its tensors are of step {header['step']}")
    if "rng/cpu" not in where:
        raise _corrupt(path / stored_file(meta), "it has no rng/cpu tensor")
    keys = _grouped(where)
    small = {kind: {name: _read(*where[k]) for name, k in keys[kind].items()} for kind in ("buffer", "scaler")}
    state = TrainState(params=stored_tensors({n: where[k] for n, k in keys["param"].items()}),
                       optim=stored_optim({n: {p: where[k] for p, k in st.items()} for n, st in keys["optim"].items()}),
                       buffers=small["buffer"], scaler=small["scaler"])
    rng = {k: _read(*where[k]) for k in keys["rng"].values()}
    return Checkpoint(path=path, step=meta["step"], meta=meta, state=state, rng=rng, stored=stored)


def _grouped(keys: Iterable[str]) -> dict[str, dict]:
    """A checkpoint's tensor keys by kind (see the module docstring): ``param`` and ``buffer`` and ``scaler``
    name → key, ``optim`` parameter name → {``step`` | ``exp_avg`` | ``exp_avg_sq`` → key}, ``rng`` key → key."""
    out: dict[str, dict] = {"param": {}, "optim": {}, "buffer": {}, "scaler": {}, "rng": {}}
    for k in keys:
        kind, _, rest = k.partition("/")
        if kind == "optim":
            name, _, part = rest.rpartition("/")
            out["optim"].setdefault(name, {})[part] = k
        elif kind in ("param", "buffer", "scaler"):
            out[kind][rest] = k
        else:
            out["rng"][k] = k
    return out


def stored_file(meta: dict) -> str:
    """The name of a checkpoint's first state file."""
    return next(iter(meta.get("files") or [STATE_FILE]))


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
    if meta["step"] < 0 or (meta["format_version"] == 2 and STATE_FILE not in meta.get("files", {})):
        raise _corrupt(file, "its step is negative or the state file's checksum is missing")
    if meta["format_version"] >= 3 and (not meta.get("files") or any(
            not isinstance(n, str) or Path(n).name != n or not n.endswith(".safetensors") for n in meta["files"])):
        raise _corrupt(file, "its list of state files is empty or names a file outside the checkpoint")
    return meta


def check_tensors(ckpt: Checkpoint, fingerprint: dict) -> None:
    """Refuse tensors that are not the model's: a parameter missing, extra or of another shape, or an AdamW
    moment missing or of another shape than its parameter (read from the files' headers: nothing loaded)."""
    want = {n: list(s) for n, s in fingerprint["params"].items()}
    stored = ckpt.stored

    def file(key: str) -> Path:
        return ckpt.path / stored[key][0]

    keys = _grouped(stored)
    params, optim = keys["param"], keys["optim"]
    if missing := sorted(want.keys() - params.keys()):
        raise _corrupt(ckpt.path / stored_file(ckpt.meta), f"parameter {missing[0]} is missing")
    for name, key in params.items():
        if name not in want:
            raise _corrupt(file(key), f"it holds parameter {name}, which the model has not")
        if stored[key][1] != want[name]:
            raise _corrupt(file(key), f"parameter {name} has shape {stored[key][1]}, the model's is {want[name]}")
    parts = {p for st in optim.values() for p in st}
    for name, st in optim.items():  # a parameter that never had a gradient has no state: not checked
        first = next(iter(st.values()))
        if name not in want:
            raise _corrupt(file(first), f"it holds optimizer state of {name}, a parameter the model has not")
        if lacking := sorted(parts - st.keys()):
            raise _corrupt(file(first), f"optimizer tensor optim/{name}/{lacking[0]} is missing")
        for part, key in st.items():
            if part != "step" and stored[key][1] != want[name]:
                raise _corrupt(file(key), f"optimizer tensor {key} has shape {stored[key][1]}, its parameter's is "
                                          f"{want[name]}")


def check_tokenizer(ckpt: Checkpoint, tokenizer: str) -> None:
    """Refuse a checkpoint trained with another tokenizer than ``tokenizer`` (a BPE the changed corpus trained
    anew): its model would read other ids. A checkpoint that records none (older) passes."""
    saved = ckpt.meta.get("tokenizer")
    if saved and saved != tokenizer:
        raise StratumError(f"checkpoint {ckpt.path} was trained with tokenizer {saved}, and its corpus now gives "
                           f"{tokenizer} (a BPE is trained on the corpus: it changed since); restore the corpus as "
                           "it was, or train anew in a new train.out_dir")


def check_compatible(ckpt: Checkpoint, cfg: Config, fingerprint: dict) -> list[str]:
    """Refuse a checkpoint of another model or data stream; return the harmless differences (for a warning)."""
    changed = check_settings(ckpt.path, ckpt.meta["config"], cfg)
    if fingerprint_hash(fingerprint) != ckpt.meta.get("fingerprint_hash"):
        raise StratumError(f"checkpoint {ckpt.path} holds a different model architecture than the one configured "
                           "(parameter names or shapes differ); use a new train.out_dir")
    check_tensors(ckpt, fingerprint)
    return changed


def check_recorded_settings(path: Path, cfg: Config) -> None:
    """:func:`check_settings` from the checkpoint's ``meta.json`` alone: before the work a refused resume would
    waste (a BPE trained on the corpus, the model built)."""
    check_settings(path, _read_meta(path)["config"], cfg)


def check_settings(path: Path, saved: dict, cfg: Config) -> list[str]:
    """Refuse a checkpoint (at ``path``, trained with the config ``saved``) of another model or data stream;
    return the harmless differences."""
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
        raise StratumError(f"checkpoint {path} is from a different model/data setup ({'; '.join(refused)}); "
                           "use the original settings or a new train.out_dir")
    if str(before.plan) != str(cfg.plan):  # the keys that make the plan say less than the plan itself does
        changed = [f"plan: {str(before.plan)!r} → {str(cfg.plan)!r}"] + [
            c for c in changed if not c.startswith(PLAN_KEYS)]
    return changed


PLAN_KEYS = ("train.engine:", "parallel.plan:", "pipeline.")
"""The settings a run's plan tree is made from (beside each leaf's offload.* budgets, which stay noted on their
own): a resume under another plan notes the plans, not these."""
