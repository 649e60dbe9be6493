"""``stratum export``: a trained checkpoint as a ``save_pretrained`` directory that ``transformers`` loads.

    stratum export runs/default --out exported/      # then AutoModelForCausalLM.from_pretrained("exported/")

An hf-source model is written as its own architecture; Stratum's own GPT as GPT-2 (the shapes match, see
:mod:`stratum.model.export`). A BPE tokenizer goes along as ``tokenizer.json`` (AutoTokenizer loads it); the byte
tokenizer has no transformers counterpart: token id = byte value. The directory is written under a temporary
name and renamed into place, so a failed export leaves nothing half-written. This module imports nothing heavy at
load, so building the CLI's parser stays quick.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

from stratum.errors import StratumError

log = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a trained checkpoint as a transformers save_pretrained directory")
    p.add_argument("run", nargs="?", default="runs/default", metavar="RUN",
                   help="a run's out_dir (its latest checkpoint) or a checkpoints/step_* directory "
                        "(default: runs/default)")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to create (must not exist or be empty)")
    return p


def run(args: argparse.Namespace) -> int:
    from stratum.model.export import to_transformers
    from stratum.train.trained import load_trained

    out = _check_out(Path(args.out).expanduser())
    trained = load_trained(args.run)
    model = to_transformers(trained.model)
    export_dir(model, trained.tokenizer, out, max_len=trained.cfg.data.seq_len)
    arch = type(model).__name__
    log.info("exported %s (%s source, step %d) from %s as %s to %s", trained.model.info.name,
             trained.cfg.model.source, trained.step, trained.path, arch, out)
    if not (out / "tokenizer.json").exists():
        log.info("the %s tokenizer has no transformers form: token ids are %s", trained.tokenizer.name,
                 "byte values" if trained.tokenizer.name == "byte" else "the tokenizer's")
    return 0


def _check_out(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise StratumError(f"--out {str(out)!r} is a file; name a new directory for the export")
    if out.exists() and any(out.iterdir()):
        raise StratumError(f"--out {str(out)!r} already exists and is not an empty directory; choose a new "
                           "directory (an export never overwrites one)")
    if out.parent.exists() and not out.parent.is_dir():
        raise StratumError(f"--out {str(out)!r}: its parent is not a directory")
    return out


def export_dir(model, tokenizer, out: Path, *, max_len: int) -> None:
    """``model.save_pretrained`` and, for a BPE tokenizer, ``tokenizer.json`` into ``out``, all or nothing."""
    from safetensors import SafetensorError

    from stratum.atomic import atomic_replace_dir, default_modes
    from stratum.model.export import save_pretrained

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise StratumError(f"cannot write to {str(out.parent)!r} ({e.strerror}); choose a writable --out") from None
    try:
        save_pretrained(model, str(tmp))
        if hasattr(tokenizer, "to_json"):
            (tmp / "tokenizer.json").write_text(tokenizer.to_json())
            (tmp / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}, indent=2) + "\n")
        default_modes(tmp)  # (mkdtemp makes it 0o700)
        if out.exists():
            out.rmdir()  # checked empty above
        atomic_replace_dir(tmp, out)
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(e, "strerror", None) or str(e).strip().splitlines()[0]
        raise StratumError(f"cannot write the export to {str(out)!r} ({reason}); free space or choose "
                           "another --out") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
