"""The command line: every bad input is one line on stderr, exit code 2, no traceback, nothing lost."""

import json
import os
import subprocess
import sys

import pytest
import torch

from stratum.cli import main
from stratum.train.checkpoint import latest_checkpoint


def _base(corpus_file, cache_dir, out):
    return ["--set", f"data.corpus={str(corpus_file)!r}", "--set", f"data.cache_dir={str(cache_dir)!r}",
            "--set", "model.preset='tiny'", "--set", "data.seq_len=32", "--set", "train.micro_batch_size=4",
            "--set", "train.steps=4", "--set", "train.eval_interval=0", "--set", f"train.out_dir={str(out)!r}"]


def test_train_profile_config_and_dry_run(corpus_file, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *_base(corpus_file, cache_dir, out)]) == 0
    text = capsys.readouterr().out
    assert "tokens/step = 4 × 32 = 128" in text and "done: 4/4 steps" in text
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4

    threads = torch.get_num_threads()
    try:  # measured at the threads the run is given
        assert main(["profile", *_base(corpus_file, cache_dir, out), "--out", str(tmp_path / "p.json"),
                     "--runs", "1", "--set", "train.threads=1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "p.json").read_text())["blocks"][1]["name"] == "layer.0"
    assert "profile of tiny on cpu (1 thread)" in capsys.readouterr().out

    assert main(["config"]) == 0
    assert "grad_accum = 1" in capsys.readouterr().out

    assert main(["train", "--dry-run", "--set", "model.preset='gpt-6.7b'"]) == 0
    text = capsys.readouterr().out
    assert "6,658,404,352 parameters" in text and "tied: blocks.0.tok.weight = blocks.33.weight" in text


def _bad_cases(tmp_path, corpus_file):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[train]\nsteps = ")
    return {
        "unknown key": (["--set", "train.stpes=3"], "unknown key train.stpes"),
        "unknown key in file": (["--config", str(_toml(tmp_path, "[train]\nsped = 1\n"))], "unknown key train.sped"),
        "wrong type": (["--set", "train.micro_batch_size='big'"], "must be an integer"),
        "impossible value": (["--set", "train.grad_accum=0"], "train.grad_accum must be ≥ 1"),
        "missing config": (["--config", str(tmp_path / "none.toml")], "does not exist"),
        "bad toml": (["--config", str(bad_toml)], "not valid TOML"),
        "missing corpus": (["--set", f"data.corpus={str(tmp_path / 'nope')!r}"], "does not exist"),
        "empty corpus": (["--set", f"data.corpus={str(empty)!r}"], "holds no text"),
        "unwritable out_dir": (["--set", f"train.out_dir={str(afile / 'sub')!r}"],
                               f"{afile} is a file, not a directory"),
        "out_dir a file": (["--set", f"train.out_dir={str(afile)!r}"], f"{afile} is a file, not a directory"),
        "seq too long": (["--set", "data.seq_len=1000"], "exceeds preset 'tiny'"),
        "vocab too small": (["--set", "model.vocab_size=100"], "smaller than the tokenizer"),
        "no cuda": (["--set", "train.device='cuda'"], "no usable CUDA"),
        "bad stop-at": (["--stop-at", "0"], "--stop-at must be ≥ 1"),
    }


def _toml(tmp_path, text):
    p = tmp_path / "x.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("case", ["unknown key", "unknown key in file", "wrong type", "impossible value",
                                  "missing config", "bad toml", "missing corpus", "empty corpus",
                                  "unwritable out_dir", "out_dir a file", "seq too long", "vocab too small", "no cuda",
                                  "bad stop-at"])
def test_bad_input_is_one_line_exit_2(case, corpus_file, cache_dir, tmp_path, capsys):
    args, message = _bad_cases(tmp_path, corpus_file)[case]
    if case == "no cuda" and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = main(["train", *_base(corpus_file, cache_dir, tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("stratum: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_incompatible_checkpoint_is_refused_and_kept(corpus_file, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *_base(corpus_file, cache_dir, out), "--stop-at", "2"]) == 0
    ckpt = latest_checkpoint(out)
    before = (ckpt / "state-00000.safetensors").read_bytes()
    code = main(["train", *_base(corpus_file, cache_dir, out), "--set", "model.preset='mini'"])
    err = capsys.readouterr().err
    assert code == 2 and "different model/data setup" in err and err.count("\n") == 1
    assert (ckpt / "state-00000.safetensors").read_bytes() == before


def test_subprocess_has_no_traceback(tmp_path):
    """Through the real entry point: exit status 2 and a single line, whatever the failure."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "stratum", "train", "--set", "train.steps=-3"], capture_output=True,
                       text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == "stratum: error: train.steps must be ≥ 1"
    r = subprocess.run([sys.executable, "-m", "stratum", "train", "--bogus"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr


def test_help_usage_errors_and_config_do_not_import_torch():
    """`stratum --help`, a mistyped flag and `stratum config` answer at once: the grammar and the config's
    validation import no torch (it takes seconds to import)."""
    code = ("import sys\nfrom stratum.cli import build_parser, main\nbuild_parser()\n"
            "assert main(['config']) == 0\n"
            "assert main(['train', '--set', 'model.preset=\"bogus\"']) == 2\n"
            "from stratum.config import load_config\nload_config(None, ['model.preset=\"gpt2-124m\"'])\n"
            "import stratum.dist.roles  # a launcher starts the ranks' forkserver before it imports torch\n"
            "assert 'torch' not in sys.modules, 'the command line imported torch before running a command'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_profile_and_plan_measure_at_the_threads_each_process_of_the_run_gets(monkeypatch, tmp_path):
    """A plan of several local processes trains each on its share of the cores: its profile and its memory plan
    are measured at that share, as its dry run is (not at this process's all)."""
    from stratum.profile import profiler
    from stratum.train.threads import threads_among

    seen: list[int] = []

    def measured(*a, **k):
        seen.append(torch.get_num_threads())
        raise SystemExit(0)
    monkeypatch.setattr(profiler, "profile_from_config", measured)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # (as a process alone on two cores has them)
        want = threads_among(2)
        with pytest.raises(SystemExit):
            main(["profile", "--set", "model.preset='tiny'", "--set", "parallel.plan='pipeline(2)'",
                  "--set", "train.grad_accum=2", "--out", str(tmp_path / "p.json")])
    finally:
        torch.set_num_threads(threads)
    assert seen == [want]
