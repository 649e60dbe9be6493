"""Hardening (issue 16): help for every command; files that cannot be written (on real full and read-only tmpfs
mounts where this machine permits mounting); a disk tier that leaves nothing after kill -9; one run per out_dir
and what a killed write leaves; corrupt checkpoints and token caches; numbers and text that make no sense; sizes
checked before work; threads; a crashed rank in a multi-process run. The seeded fuzz of every subcommand is
tests/test_fuzz.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stratum.cli import build_parser, main


def _command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every (sub)command of ``parser`` as its argv prefix, the top level included."""
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths += _command_paths(sub, prefix + (name,))
    return paths


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_prints_help(flag, capsys):
    paths = _command_paths(build_parser())
    assert ("plan",) in paths and len(paths) >= 6
    for path in paths:
        with pytest.raises(SystemExit) as exc:
            main([*path, flag])
        assert exc.value.code == 0, path
        assert "usage: stratum" in capsys.readouterr().out, path


# --- files that cannot be written ----------------------------------------------------------------------------


@contextlib.contextmanager
def _mounted_tmpfs(where: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """A real filesystem of ``size`` (tmpfs) at ``where``; skips the test where mounting is not permitted."""
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot make a small or read-only filesystem here")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({res.stderr.strip() or res.returncode})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(fs: Path, leave: int = 0) -> Path:
    """Fill ``fs`` until ``leave`` bytes are free; the filler file is returned (delete it to free the space)."""
    filler = fs / "filler"
    free = shutil.disk_usage(fs).free - leave
    with filler.open("wb") as fh:
        with contextlib.suppress(OSError):
            fh.write(b"\0" * max(free, 0))
    return filler


@pytest.fixture
def full_fs(tmp_path) -> Iterator[Path]:
    with _mounted_tmpfs(tmp_path / "full", "1m") as fs:
        _fill(fs)
        yield fs


@pytest.fixture
def ro_fs(tmp_path) -> Iterator[Path]:
    with _mounted_tmpfs(tmp_path / "ro", "1m", read_only=True) as fs:
        yield fs


def _unwritable_targets(tmp_path: Path, full: Path, ro: Path) -> dict[str, Path]:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    adir = tmp_path / "a-dir"
    adir.mkdir()
    return {"parent is a file": afile / "out.json", "target is a directory": adir, "full": full / "out.json",
            "read-only": ro / "out.json"}


def _one_error_line(capsys, *expected: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("stratum: error: "), err
    assert "Traceback" not in err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def small(corpus_file, cache_dir) -> list[str]:
    """Config flags of a tiny model on the test corpus."""
    return ["--set", f"data.corpus={str(corpus_file)!r}", "--set", f"data.cache_dir={str(cache_dir)!r}",
            "--set", "model.preset='tiny'", "--set", "data.seq_len=32", "--set", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def profile(small, tmp_path_factory) -> Path:
    """A `stratum profile` of the tiny model, so `stratum plan` need not profile again."""
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    assert main(["profile", *small, "--runs", "1", "--out", str(path)]) == 0
    return path


def test_every_output_flag_fails_cleanly(tmp_path, full_fs, ro_fs, small, profile, capsys):
    """``--save``, ``--trace``, ``--png``, ``--json`` and ``--out`` into a file's child, onto a directory, onto a
    full and onto a read-only filesystem: one line naming the file, exit code 2, no temp file left."""
    capsys.readouterr()
    commands = {
        "--save": ["schedule", "show", "--save"],
        "--trace": ["schedule", "simulate", "--trace"],
        "--png": ["schedule", "simulate", "--png"],
        "--json": ["plan", *small, "--profile", str(profile), "--json"],
        "--out": ["profile", *small, "--runs", "1", "--out"],
    }
    # the schedule's writes cost nothing and meet every failure; plan and profile (which measure first) one each
    costly = {"--json": ("full", "target is a directory"), "--out": ("read-only",)}
    for kind, target in _unwritable_targets(tmp_path, full_fs, ro_fs).items():
        for flag, argv in commands.items():
            if flag in costly and kind not in costly[flag]:
                continue
            path = target.with_suffix(".png") if flag == "--png" and target.suffix else target  # (a PNG's name)
            assert main([*argv, str(path)]) == 2, (flag, kind)
            _one_error_line(capsys, "cannot write", str(path))
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_checkpoint_on_a_full_filesystem_stops_cleanly_and_resumes_once_freed(make_cfg, tmp_path):
    """The checkpoint that does not fit stops the run with one line; the earlier one stays and the run resumes."""
    from stratum.errors import StratumError
    from stratum.train.checkpoint import latest_checkpoint, load_checkpoint
    from stratum.train.trainer import read_metrics, train

    with _mounted_tmpfs(tmp_path / "fs", "4m") as fs:
        out = fs / "run"
        cfg = make_cfg("train.steps=4", out=out)
        train(cfg, stop_at=2)
        first = latest_checkpoint(out)
        ckpt_bytes = sum(p.stat().st_size for p in first.iterdir())
        filler = _fill(fs, leave=ckpt_bytes // 2)  # room for metrics lines, not for a checkpoint
        with pytest.raises(StratumError, match="cannot write checkpoint .*No space left.*resume"):
            train(cfg)
        assert latest_checkpoint(out) == first and load_checkpoint(first).step == 2
        assert not list((out / "checkpoints").glob(".tmp*"))
        filler.unlink()
        summary = train(cfg)
        assert summary["steps_done"] == 4 and summary["steps_this_run"] == 2
        assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


@pytest.mark.parametrize("where", ["full", "read-only"])
def test_token_cache_and_out_dir_on_unwritable_filesystems(where, full_fs, ro_fs, corpus_file, tmp_path, capsys):
    fs = full_fs if where == "full" else ro_fs
    base = ["train", "--set", f"data.corpus={str(corpus_file)!r}", "--set", "model.preset='tiny'",
            "--set", "data.seq_len=32"]
    assert main([*base, "--set", f"data.cache_dir={str(fs / 'cache')!r}",
                 "--set", f"train.out_dir={str(tmp_path / 'run')!r}"]) == 2
    _one_error_line(capsys, "token cache")
    assert main([*base, "--set", f"train.out_dir={str(fs / 'run')!r}"]) == 2
    _one_error_line(capsys, "train.out_dir", "not writable")
    assert [p.name for p in fs.iterdir()] == (["filler"] if where == "full" else [])


def _snapshot(root: Path, skip: str = "") -> dict[str, bytes]:
    """Every file under ``root`` (but ``skip``) by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != skip}


def _without(snapshot: dict[str, bytes], name: str) -> dict[str, bytes]:
    return {k: v for k, v in snapshot.items() if Path(k).name != name}


# --- the disk tier leaves nothing behind; one run per out_dir ----------------------------------------------


def _open_files_under(pid: int, where: Path) -> list[str]:
    """What the descriptors of process ``pid`` point at under ``where`` (unlinked files included)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    targets = []
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            targets.append(os.readlink(fd))
    return [t for t in targets if t.startswith(str(where))]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see the run's open files")
def test_kill_9_during_the_disk_tier_leaves_no_file_and_a_second_run_is_refused(corpus_file, cache_dir, tmp_path,
                                                                                 capsys):
    disk, out = tmp_path / "disk", tmp_path / "run"
    sets = [f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}", "model.preset='tiny'",
            "data.seq_len=32", "train.micro_batch_size=2", "train.steps=1000", "train.eval_interval=0",
            "train.engine='offload'", "offload.optimizer_tier='disk'", f"offload.disk_dir={str(disk)!r}",
            f"train.out_dir={str(out)!r}"]
    p = subprocess.Popen([sys.executable, "-m", "stratum", "train", *[a for s in sets for a in ("--set", s)]],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1]
        held = _open_files_under(p.pid, disk)
        assert held and all(t.endswith("(deleted)") for t in held), held  # the tier is in use, its files nameless
        # a second run into the live run's out_dir is refused, and touches nothing there
        before = _snapshot(out)
        assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 2
        _one_error_line(capsys, "in use by another stratum run")
        assert p.poll() is None and _snapshot(out, skip="metrics.jsonl") == _without(before, "metrics.jsonl")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert not list(disk.iterdir())
    # the kernel dropped the dead run's lock: the next run proceeds
    plain = [*sets, "train.engine='plain'"]  # faster, and the run's engine is free to change
    assert main(["train", *[a for s in plain for a in ("--set", s)], "--stop-at", "1"]) == 0


@pytest.mark.parametrize("where", ["full", "read-only"])
def test_disk_tier_on_a_full_or_read_only_disk_is_one_line(where, full_fs, ro_fs, small, profile, capsys):
    """The disk tier's start-up (the writability check, the bandwidth probe, the plan) on a disk without room."""
    fs = full_fs if where == "full" else ro_fs
    capsys.readouterr()
    argv = ["plan", *small, "--profile", str(profile), "--set", "offload.optimizer_tier='disk'",
            "--set", f"offload.disk_dir={str(fs)!r}"]
    assert main(argv) == 2
    _one_error_line(capsys, "offload.disk_dir")


@pytest.mark.parametrize("setting, said", [("train.micro_batch_size=4", "micro_batch 2 (the config's: 4)"),
                                            ("data.seq_len=64", "seq_len 32 (the config's: 64)"),
                                            ("train.precision='bf16'", "precision fp32 (the config's: bf16)"),
                                            # another model of as many blocks (a BPE's vocabulary, say)
                                            ("model.vocab_size=512", "block 0 (embed) of 32,768 parameters "
                                                                     "(the config's: 49,152)")])
def test_a_profile_of_another_batch_shape_is_refused_by_both_planners(setting, said, small, profile, capsys):
    """Its bytes and seconds are another shape's: the plans would approve budgets the run refuses."""
    capsys.readouterr()
    for argv in (["plan", *small, "--profile", str(profile), "--set", setting],
                 ["plan", "--parallel", "--devices", "2", *small, "--profile", str(profile), "--set", setting]):
        assert main(argv) == 2
        _one_error_line(capsys, f"was taken with {said}")


@pytest.mark.parametrize("argv, said", [
    (["simulate", "--png", "x.svg"], "--png 'x.svg' must end in .png"),
    (["simulate", "--trace", "same.png", "--png", "same.png"], "two output flags name the same file"),
    (["show", "--save", ""], "no file given for --save"),
])
def test_schedule_outputs_are_checked_before_any_work(argv, said, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["schedule", *argv, "--kind", "1f1b", "--ranks", "2", "--microbatches", "2"]) == 2
    _one_error_line(capsys, said)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("out", ["", "DIR"])
def test_profile_refuses_an_unwritable_out_before_measuring(out, small, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("stratum.profile.profiler.profile_from_config",
                        lambda *a, **k: pytest.fail("measured before checking --out"))
    capsys.readouterr()
    assert main(["profile", *small, "--out", str(tmp_path) if out == "DIR" else out]) == 2
    _one_error_line(capsys, "the profile")


def test_output_piped_to_a_reader_that_leaves_is_no_traceback():
    """`stratum … | head -1`: the reader closes the pipe; the command stops quietly."""
    res = subprocess.run(f"{sys.executable} -m stratum schedule show --kind 1f1b --ranks 64 --microbatches 64 | head -1",
                         shell=True, capture_output=True, text=True, timeout=120)
    assert res.stdout.startswith("1f1b: 64 stages") and "Traceback" not in res.stderr, res.stderr


def test_a_file_where_the_checkpoints_go_is_refused_before_any_step(make_cfg, tmp_path):
    from stratum.errors import StratumError
    from stratum.train.trainer import train

    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("notes")
    with pytest.raises(StratumError, match="checkpoints is a file, where the run keeps its checkpoints"):
        train(make_cfg(out=out))
    assert not (out / "metrics.jsonl").exists() and (out / "checkpoints").read_text() == "notes"


def test_a_held_out_dir_is_refused_in_one_line(make_cfg, tmp_path):
    from stratum.errors import StratumError
    from stratum.train.lock import hold_out_dir
    from stratum.train.trainer import train

    out = tmp_path / "run"
    out.mkdir()
    with hold_out_dir(out):
        with pytest.raises(StratumError, match="in use by another stratum run"):
            train(make_cfg(out=out))
        assert not list(out.iterdir())
    assert train(make_cfg("train.steps=2", out=out))["steps_done"] == 2  # released on leaving


def test_resume_clears_what_a_killed_checkpoint_write_left(make_cfg, tmp_path):
    """Temp files and an unrenamed checkpoint directory go; a checkpoint set aside for a replacement that never
    arrived is put back and resumed from."""
    from stratum.train.checkpoint import latest_checkpoint
    from stratum.train.trainer import read_metrics, train

    out = tmp_path / "run"
    cfg = make_cfg("train.steps=4", "train.ckpt_interval=1", out=out)
    train(cfg, stop_at=2)
    root = out / "checkpoints"
    os.replace(root / "step_00000002", root / ".step_00000002.old")  # killed inside atomic_replace_dir
    (root / ".tmp_step_00000003").mkdir()
    (root / ".tmp_step_00000003" / "state-00000.safetensors").write_bytes(b"half")
    for leftover in (root / ".latest.x1.tmp", out / ".summary.json.x2.tmp", out / ".metrics.jsonl.x3.tmp"):
        leftover.write_text("half")
    summary = train(cfg)
    assert summary["steps_this_run"] == 2 and [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert latest_checkpoint(out).name == "step_00000004"
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp") or p.name.startswith((".tmp", ".step"))]


def test_stop_at_below_the_checkpoint_leaves_the_summary(make_cfg, tmp_path, capsys):
    import json

    from stratum.train.trainer import train

    out = tmp_path / "run"
    cfg = make_cfg("train.steps=6", out=out)
    train(cfg, stop_at=4)
    before = (out / "summary.json").read_text()
    summary = train(cfg, stop_at=2)
    assert (out / "summary.json").read_text() == before and summary == json.loads(before)
    assert summary["steps_done"] == 4 and summary["steps_this_run"] == 4


# --- corrupt files are detected, not trained on --------------------------------------------------------------


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])


def _edit_meta(ckpt: Path, **fields) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, **fields}))


def _rewrite_state(ckpt: Path, change) -> None:
    """Rewrite the tensors with ``change`` applied and record the new file's checksum: a deliberate edit that
    only the structural checks can catch."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from stratum.atomic import file_digest

    path = ckpt / "state-00000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(path), metadata=header)
    meta = json.loads((ckpt / "meta.json").read_text())
    _edit_meta(ckpt, files={**meta["files"], "state-00000.safetensors": file_digest(path)})


def _drop_a_moment(tensors: dict) -> None:
    del tensors[next(k for k in sorted(tensors) if k.startswith("optim/") and k.endswith("/exp_avg"))]


def _reshape_a_matrix(tensors: dict) -> None:
    name = next(k for k in sorted(tensors) if k.startswith("param/") and tensors[k].dim() == 2)
    tensors[name] = tensors[name].reshape(tensors[name].shape[1], tensors[name].shape[0]).contiguous()


STATE = "state-00000.safetensors"
CHECKPOINT_CORRUPTIONS = {
    "flipped bit": (lambda d: _flip_bit(d / STATE), STATE, "SHA-256"),
    "truncated tensors": (lambda d: _truncate(d / STATE), STATE, "bytes where"),
    "meta step disagrees": (lambda d: _edit_meta(d, step=3), "meta.json", "says step 3, its tensors are of step 2"),
    "garbage meta": (lambda d: (d / "meta.json").write_text("{\"step\": 2,"), "meta.json", "unreadable"),
    "meta nested too deeply": (lambda d: (d / "meta.json").write_text("[" * 100_000 + "]" * 100_000), "meta.json",
                               "unreadable"),
    "meta without state files": (lambda d: _edit_meta(d, files={}), "meta.json", "list of state files is empty"),
    "meta naming a file outside": (lambda d: _edit_meta(d, files={"../../x.safetensors": {}}), "meta.json",
                                   "names a file outside the checkpoint"),
    "missing optimizer tensor": (lambda d: _rewrite_state(d, _drop_a_moment), STATE, "is missing"),
    "reshaped parameter": (lambda d: _rewrite_state(d, _reshape_a_matrix), STATE, "has shape"),
}


def test_corrupt_checkpoints_are_refused_naming_the_file(make_cfg, tmp_path):
    from stratum.errors import StratumError
    from stratum.train.checkpoint import latest_checkpoint
    from stratum.train.trainer import train

    good = tmp_path / "good"
    train(make_cfg("train.steps=4", out=good), stop_at=2)
    for case, (corrupt, file, text) in CHECKPOINT_CORRUPTIONS.items():
        out = tmp_path / case.replace(" ", "-")
        shutil.copytree(good, out)
        corrupt(latest_checkpoint(out))
        before = _snapshot(out)
        with pytest.raises(StratumError) as exc:
            train(make_cfg("train.steps=4", out=out))
        msg = str(exc.value)
        assert file in msg and text in msg and "\n" not in msg, (case, msg)
        assert _snapshot(out) == before, case  # nothing trained, nothing rewritten
    assert train(make_cfg("train.steps=4", out=good))["steps_done"] == 4  # the intact copy resumes


def test_corrupt_token_cache_and_tokenizer_are_refused_naming_the_file(make_cfg, tmp_path):
    from stratum.data.prepare import prepare_data
    from stratum.errors import StratumError

    cache = tmp_path / "cache"
    cfg = make_cfg(f"data.cache_dir={str(cache)!r}", "data.tokenizer='bpe'", "data.bpe_vocab_size=300",
                   "model.vocab_size=300")
    prepare_data(cfg)
    tokens = next(cache.glob("tokens-*.bin"))
    meta = tokens.with_suffix(".json")
    tokenizer = next(cache.glob("bpe-*.json"))
    pristine = {p: p.read_bytes() for p in (tokens, meta, tokenizer)}
    cases = {
        "flipped bit": (lambda: _flip_bit(tokens), tokens, "SHA-256"),
        "truncated": (lambda: _truncate(tokens), tokens, "bytes where"),
        "garbage metadata": (lambda: meta.write_text("[1, 2"), meta, "unreadable"),
        "metadata without a count": (lambda: meta.write_text("{}"), meta, "tokens or dtype"),
        "garbage tokenizer": (lambda: tokenizer.write_text("{\"model\": 7}"), tokenizer, "delete it"),
    }
    for case, (corrupt, file, text) in cases.items():
        corrupt()
        with pytest.raises(StratumError) as exc:
            prepare_data(cfg)
        msg = str(exc.value)
        assert str(file) in msg and text in msg and "\n" not in msg, (case, msg)
        for p, data in pristine.items():
            p.write_bytes(data)
    assert prepare_data(cfg).n_tokens > 0


# --- numbers and text that make no sense ---------------------------------------------------------------------

# (argv, text the one error line holds): each is refused before any work
NONSENSE = {
    "lr inf": (["train", "--set", "optim.lr=inf"], "optim.lr must be a finite number"),
    "eps inf": (["train", "--set", "optim.eps=inf"], "optim.eps must be a finite number"),
    "lr nan": (["train", "--set", "optim.lr=nan"], "optim.lr must be a finite number"),
    "latency nan": (["schedule", "simulate", "--latency", "nan"], "--latency must be a finite number"),
    "latency inf": (["schedule", "simulate", "--latency", "inf"], "--latency must be a finite number"),
    "bandwidth nan": (["schedule", "simulate", "--bandwidth", "nan"], "--bandwidth a number > 0"),
    "seed too large": (["train", "--set", f"train.seed={2**63}"], "train.seed must be in [0, 2**63 - 1"),
    "huge schedule": (["schedule", "show", "--ranks", "2000", "--microbatches", "2000"],
                      "--ranks × --microbatches = 4,000,000 is more than the 100,000 a 1f1b schedule"),
    "huge interleaved": (["schedule", "show", "--kind", "interleaved", "--ranks", "100", "--microbatches", "100",
                          "--virtual", "20"], "--ranks × --microbatches × --virtual = 200,000"),
    "path too long": (["train", "--set", f"train.out_dir='/tmp/{'a' * 300}/run'"], "is too long for the filesystem"),
    "config path too long": (["sweep", "status", "/tmp/" + "b" * 300], "is too long for the filesystem"),
    "run timeout negative": (["run", "--nproc", "2", "--timeout-s", "-5", "x.py"], "--timeout-s must be a finite"),
    "run timeout nan": (["run", "--nproc", "2", "--timeout-s", "nan", "x.py"], "--timeout-s must be a finite"),
    "run a directory": (["run", "--nproc", "2", "/tmp"], "is a directory; give the Python file to run"),
    "balanced, no profile": (["schedule", "simulate", "--partition", "balanced"], "give --profile FILE"),
    "no micro-batch": (["schedule", "validate", "--kind", "1f1b", "--microbatches", "0"], "--microbatches must be"),
    "huge searched": (["schedule", "validate", "--kind", "zb-wave", "--ranks", "100", "--microbatches", "100",
                       "--waves", "3"], "30,000 is more than the 20,000 a zb-wave schedule"),
    "undecodable out_dir": (["train", "--set", "train.out_dir=r\udcff"], "not valid UTF-8"),
    "undecodable cache_dir": (["plan", "--set", "data.cache_dir=c\udcfe"], "data.cache_dir holds bytes"),
    "undecodable disk_dir": (["train", "--set", "offload.disk_dir=d\udcfd"], "offload.disk_dir holds bytes"),
    "no such user": (["train", "--set", "train.out_dir='~nosuchuser-stratum/x'"], "names no user"),
    "non-ASCII digit": (["train", "--set", "train.device='cuda:\u0663'"], "is not auto, cpu, cuda or cuda:N"),
    "superscript digit": (["profile", "--set", "train.device='cuda:\u00b2'"], "is not auto, cpu, cuda or cuda:N"),
    "unused pipeline schedule": (["train", "--set", "pipeline.schedule='xxxx'"], "neither a schedule kind"),
}


@pytest.mark.parametrize("case", list(NONSENSE))
def test_nonsense_is_one_line(case, capsys):
    argv, text = NONSENSE[case]
    assert main(argv) == 2
    _one_error_line(capsys, text)


def test_deeply_nested_toml_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.toml"
    deep.write_text("[train]\nsteps = " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert main(["train", "--config", str(deep)]) == 2
    _one_error_line(capsys, "nests arrays or tables too deeply")


def test_a_loss_that_turns_nan_stops_the_run_naming_the_step(make_cfg, tmp_path):
    from stratum.errors import StratumError
    from stratum.train.checkpoint import latest_checkpoint
    from stratum.train.trainer import read_metrics, train

    out = tmp_path / "run"
    with pytest.raises(StratumError, match=r"the loss became nan at step 2; .*no checkpoint of this state"):
        train(make_cfg("optim.lr=1e30", "optim.min_lr=0", "optim.warmup_steps=0", "train.ckpt_interval=1", out=out))
    assert latest_checkpoint(out).name == "step_00000001" and [r["step"] for r in read_metrics(out)] == [1]


def test_no_validation_split_means_no_evaluation(make_cfg, tmp_path):
    from stratum.train.trainer import train

    summary = train(make_cfg("data.val_fraction=0", "train.steps=2", out=tmp_path / "run"))
    assert summary["steps_done"] == 2 and summary["final_eval_loss"] is None


# --- sizes checked before work -------------------------------------------------------------------------------

TOO_BIG = {
    "vocabulary": (["--set", "model.vocab_size=1000000000"], "block embed alone needs"),
    "model on the plain engine": (["--set", "model.preset='gpt-6.7b'"], "with the offload engine"),
    "evaluation batches": (["--set", "train.eval_batches=100000000"], "token batches alone take"),
    "micro-batch": (["--set", "train.micro_batch_size=100000000"], "lower train.micro_batch_size"),
    "prefetch depth": (["--set", "offload.prefetch_depth=1000000000"], "offload.prefetch_depth must be in"),
}


@pytest.mark.parametrize("case", list(TOO_BIG))
def test_what_cannot_fit_is_refused_before_work(case, small, tmp_path, capsys):
    from stratum.runtime.device import device_memory_bytes

    flags, text = TOO_BIG[case]
    if "gpt-6.7b" in str(flags) and (device_memory_bytes(torch.device("cpu")) or 0) > 99 * 2**30:
        pytest.skip("this machine has the RAM to train gpt-6.7b on the plain engine")
    out = tmp_path / "run"
    assert main(["train", *small, "--set", f"train.out_dir={str(out)!r}", *flags]) == 2
    line = _one_error_line(capsys, text)
    assert "B " in line or "must be" in line  # the bytes it needs are named
    assert not out.exists()


# --- threads follow the cores this process may use -----------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_threads_follow_the_usable_cores_and_train_threads(make_cfg, tmp_path, monkeypatch, caplog):
    from stratum.train.threads import apply_threads
    from stratum.train.trainer import train

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        os.sched_setaffinity(0, {min(cores)})  # as taskset -c 0 does
        assert apply_threads(0).startswith("threads: 1 intra-op (auto: 1 usable core(s) / 1 process(es)")
        assert torch.get_num_threads() == 1
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(max(2, len(cores)))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(max(2, len(cores))))  # as many processes as cores here
        apply_threads(0)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        with caplog.at_level("INFO", logger="stratum"):
            train(make_cfg("train.threads=3", "train.steps=1", out=tmp_path / "run"))
        assert torch.get_num_threads() == 3 and "threads: 3 intra-op (train.threads)" in caplog.text
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


# --- distributed failures read cleanly -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_crashed_rank_is_one_line_and_its_traceback_goes_to_the_log(corpus_file, cache_dir, tmp_path):
    # (a crash in training's forward: the build's check of the model, under no_grad, passes)
    (tmp_path / "crashing_factory.py").write_text(
        "import os\n\nimport torch\nfrom torch import nn\n\nfrom stratum.model.sequential import example_lm\n\n\n"
        "class Boom(nn.Module):\n    def forward(self, x):\n"
        "        if torch.is_grad_enabled() and os.environ.get('RANK') == '1':\n"
        "            raise RuntimeError('boom on rank 1')\n        return x\n\n\n"
        "def lm(**kw):\n    return nn.Sequential(Boom(), *example_lm(**kw))\n")
    out = tmp_path / "run"
    sets = [f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}", "data.seq_len=32",
            "model.source='sequential'", "model.factory='crashing_factory:lm'", "train.micro_batch_size=2",
            "train.steps=3", "train.eval_interval=0", "parallel.plan='replicate(2)'", "parallel.timeout_s=20",
            f"train.out_dir={str(out)!r}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "stratum", "train", *[a for s in sets for a in ("--set", s)]],
                         capture_output=True, text=True, env=env, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert all(ln.startswith("stratum: error:") for ln in lines), res.stderr
    assert any(ln.startswith("stratum: error: rank 1 failed with exit code 1: RuntimeError: boom on rank 1; "
                             f"its output is in {out / 'workers.log'}") for ln in lines), res.stderr
    log = (out / "workers.log").read_text()
    assert "Traceback" in log and "[rank 1] " in log and "boom on rank 1" in log
    assert time.monotonic() - t0 < 60  # the healthy rank is not waited on for its whole time limit twice


def test_a_later_run_removes_what_killed_runs_of_earlier_versions_left(tmp_path):
    """Named tier files of a dead process (the layout before nameless files) go; a live process's stay."""
    from stratum.offload.tiers import resolve_disk_dir

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead, live = child.pid, os.getpid()
    (tmp_path / f"stratum-offload-{dead}-k2j").mkdir()
    (tmp_path / f"stratum-offload-{dead}-k2j" / "chunk0.bin").write_bytes(b"\0" * 4096)
    for name in (f".bw-{dead}-1a2b", f".stratum-direct-{dead}-3c4d", f".stratum-write-test-{dead}"):
        (tmp_path / name).write_bytes(b"x")
    kept = [f"stratum-offload-{live}-q9", f".bw-{live}-5e6f", f"bw-{dead}-not-ours", "notes.txt"]
    for name in kept:
        (tmp_path / name).write_bytes(b"x")
    assert resolve_disk_dir(str(tmp_path)) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_without_o_tmpfile_the_tier_files_are_unlinked_at_once(tmp_path, monkeypatch):
    """The fallback for file systems without O_TMPFILE: created, then unlinked before anything is written."""
    from stratum.offload.tiers import DiskStore, Tier

    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    store = DiskStore(tmp_path, Tier("disk", None))
    store.create("a", torch.arange(1000, dtype=torch.float32))
    assert not list(tmp_path.iterdir())
    assert torch.equal(store.read("a", torch.empty(1000)), torch.arange(1000, dtype=torch.float32))
    store.close()
