"""Seeded fuzz of every subcommand (issue 16): several hundred generated bad inputs, each answered with exit code 2
and one ``stratum: error:`` line, no traceback, within a per-case time limit — and an existing run's files are
untouched by all of them.

Most cases run in this process (``stratum.cli.main``, a few milliseconds each); a handful run as real
``python -m stratum`` processes (the slow part) to see the terminal's stderr as a user does.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stratum.cli import main
from stratum.config import SECTIONS

SEED = 16
PER_CASE_S = 30
"""A case that takes longer hangs (the slowest legitimate refusal profiles a tiny model: about a second)."""

# values that are wrong for every key of a type (argv text after ``--set key=``)
WRONG_FOR = {
    int: ["'abc'", "1.5", "true", "[1]", "{a = 1}", "nan", "inf", "'12'", "1e3"],
    float: ["inf", "-inf", "nan", "'abc'", "true", "[1.0]", "{a = 1.0}", "'0.1'"],
    bool: ["'yes'", "2", "1.5", "[true]", "'true'", "0"],
    str: ["'x\udcff'", "'\udcfe\udcfd'", "'a\0b'", "'\0'"],
}

# values out of a key's range or outside its choices (each refused by the config's validation)
OUT_OF_RANGE = [
    "train.steps=0", "train.steps=-3", "train.micro_batch_size=0", "train.grad_accum=0", "train.seed=-1",
    f"train.seed={2**63}", f"train.seed={2**64 + 5}", "train.eval_batches=0", "train.log_interval=0",
    "train.keep_checkpoints=0", "train.eval_interval=-1", "train.ckpt_interval=-2", "train.ckpt_minutes=-1",
    "train.threads=-1", "train.threads=100000", "train.out_dir=''", "train.out_dir='   '",
    "model.dropout=1.0", "model.dropout=-0.1", "model.vocab_size=-1", "data.seq_len=0", "data.seq_len=-7",
    "data.val_fraction=0.6", "data.val_fraction=-0.1", "data.bpe_vocab_size=256", "data.bpe_vocab_size=10000000",
    "optim.lr=0", "optim.lr=-1", "optim.min_lr=1.0", "optim.min_lr=-1e-3", "optim.beta1=1.0", "optim.beta2=-0.1",
    "optim.eps=0", "optim.warmup_fraction=1.0", "optim.warmup_steps=-2", "optim.weight_decay=-1",
    "optim.grad_clip=-1", "parallel.timeout_s=0.5", "parallel.timeout_s=1e6", "pipeline.ranks=0",
    "pipeline.virtual=0", "pipeline.waves=-1", "offload.resident_chunks=-1", "offload.prefetch_depth=-2",
    "offload.prefetch_depth=1000000000", "offload.chunk_size='1B'", "offload.chunk_size='lots'",
    "offload.device_budget='abc'", "offload.host_budget='-5GB'", "offload.device_budget='1e400GB'",
    "train.device='gpu'", "train.device='cuda:x'", "train.device='cuda:\u0663'", "train.device='cuda:-1'",
    "model.preset='nope'", "model.source='hf'",
    "parallel.plan='replicate('", "parallel.plan='foo(2)'", "parallel.plan='replicate(0)'",
    "parallel.plan='pipeline(-1)'", "parallel.speeds='a,b'", "parallel.speeds='-1'",
    "pipeline.schedule='xxxx'", "pipeline.schedule=''", "train.out_dir='~nosuchuser-stratum/run'",
    "data.cache_dir='~nosuchuser-stratum/c'", "offload.disk_dir='~nosuchuser-stratum/d'",
    "model.hf_path='~nosuchuser-stratum/m'",
]
# refused by train and plan, which read the corpus and allocate (a dry run reports sizes instead, profile reads no
# corpus)
TRAIN_AND_PLAN = ["model.vocab_size=1000000000", "train.micro_batch_size=100000000", "train.eval_batches=100000000",
                  "data.corpus='/nonexistent/corpus.txt'"]
CHOICE_KEYS = ["model.source", "data.tokenizer", "train.precision", "train.engine", "offload.optimizer_tier",
               "offload.activations", "pipeline.partition", "parallel.backend", "pipeline.schedule",
               "model.preset"]
MALFORMED_SET = ["noequals", "=1", ".=1", "train.=1", ".steps=1", "train.steps", "nosection.key=1",
                 "train.nokey=1", "train.steps=1=2", "trian.steps=3", "train.stpes=3", "model..preset=1"]


def _keys() -> dict[str, type]:
    hints = {"str": str, "int": int, "float": float, "bool": bool}
    return {f"{s}.{f.name}": hints.get(f.type, f.type) for s, cls in SECTIONS.items()
            for f in dataclasses.fields(cls)}


def _junk(rng: random.Random) -> str:
    """A random word that names no choice of any key."""
    return "".join(rng.choice("qxzjkv_-") for _ in range(rng.randint(3, 12)))


@dataclasses.dataclass
class Env:
    corpus: Path
    cache: Path
    run: Path
    """An existing, complete run: nothing may touch it."""
    tmp: Path

    def base(self) -> list[str]:
        sets = [f"data.corpus={str(self.corpus)!r}", f"data.cache_dir={str(self.cache)!r}", "model.preset='tiny'",
                "data.seq_len=32", "train.micro_batch_size=2", "train.steps=1", "train.eval_interval=0",
                f"train.out_dir={str(self.run)!r}"]
        return [a for s in sets for a in ("--set", s)]


def _files(env: Env) -> dict[str, Path]:
    """Inputs that are not what a flag wants: missing, a directory, garbage, binary, nested too deeply."""
    t = env.tmp
    f = {"missing": t / "missing.toml", "dir": t / "a-dir", "garbage": t / "garbage.txt", "binary": t / "bin.dat",
         "deep": t / "deep.toml", "scalar": t / "scalar.toml", "badsection": t / "section.toml",
         "badvalue": t / "value.toml", "badjson": t / "bad.json", "emptyjson": t / "empty.json"}
    f["dir"].mkdir(exist_ok=True)
    f["garbage"].write_text("[train\nsteps = = 3\n\x01")
    f["binary"].write_bytes(bytes(range(256)) * 4)
    f["deep"].write_text("[train]\nsteps = " + "[" * 20_000 + "]" * 20_000 + "\n")
    f["scalar"].write_text("steps = 3\n")
    f["badsection"].write_text("[trian]\nsteps = 3\n")
    f["badvalue"].write_text("[optim]\nlr = inf\n")
    f["badjson"].write_text("{\"blocks\": [1, 2")
    f["emptyjson"].write_text("{}")
    return f


def generate(env: Env, seed: int = SEED) -> list[list[str]]:
    """The bad inputs, as argv lists; the same seed gives the same list."""
    rng = random.Random(seed)
    base = env.base()
    files = _files(env)
    cases: list[list[str]] = []
    config_cmds = [["train"], ["train", "--dry-run"], ["profile", "--runs", "1", "--out", str(env.tmp / "p.json")],
                   ["plan"]]

    def with_set(item: str) -> None:
        cases.append([*rng.choice(config_cmds), *base, "--set", item])

    for key, typ in _keys().items():  # every key with two values of the wrong type
        for value in rng.sample(WRONG_FOR[typ], 2):
            with_set(f"{key}={value}")
    for item in OUT_OF_RANGE:
        with_set(item)
    for item in TRAIN_AND_PLAN:
        cases.append([rng.choice(["train", "plan"]), *base, "--set", item])
    for key in CHOICE_KEYS:
        with_set(f"{key}={_junk(rng)!r}")
    for item in MALFORMED_SET:
        with_set(item)
    for name in ("missing", "dir", "garbage", "binary", "deep", "scalar", "badsection", "badvalue"):
        for cmd in (["train"], ["profile"], ["plan"]):
            cases.append([*cmd, "--config", str(files[name]), *base])

    for bad in ("0", "-1", "x", "1.5", str(-(2**70))):
        cases.append(["train", *base, "--stop-at", bad])
    for bad in ("0", "-5", "x", "1001", str(10**12)):
        cases.append(["profile", *base, "--runs", bad])
    for target in (files["dir"], files["garbage"] / "x.json"):
        cases.append(["profile", *base, "--runs", "1", "--out", str(target)])
    for sweep in ("abc", "0%", "-1%", "2000%", ",", "1e400%", "5XB", "10%,,", "nan%", "inf%"):
        cases.append(["plan", *base, "--sweep", sweep])
    for name in ("missing", "dir", "badjson", "emptyjson", "binary"):
        cases.append(["plan", *base, "--profile", str(files[name])])
    cases.append(["plan", *base, "--json", str(files["dir"])])

    for sub in ("show", "validate", "simulate"):
        # (each knob with a kind that reads it: a kind ignores the knobs it does not read, whatever their size)
        for flag, kind in (("--ranks", "1f1b"), ("--microbatches", "1f1b"), ("--virtual", "interleaved"),
                           ("--waves", "wave")):
            for bad in rng.sample(["0", "-1", "x", "1.5", str(10**6), str(-(10**9)), ""], 3):
                cases.append(["schedule", sub, "--kind", kind, flag, bad])
        cases.append(["schedule", sub, "--kind", _junk(rng)])
        for name in ("missing", "dir", "garbage", "binary", "emptyjson"):
            cases.append(["schedule", sub, "--file", str(files[name])])
    for flag, bads in (("--latency", ["-1", "nan", "inf", "x", "-inf"]), ("--bandwidth", ["0", "-1", "nan", "x"])):
        for bad in bads:
            cases.append(["schedule", "simulate", flag, bad])
    for name in ("missing", "dir", "badjson", "emptyjson"):
        cases.append(["schedule", "simulate", "--profile", str(files[name])])
    cases.append(["schedule", "simulate", "--partition", _junk(rng)])
    for flag in ("--trace", "--png"):
        cases.append(["schedule", "simulate", flag, str(files["dir"])])
    cases.append(["schedule", "show", "--save", str(files["garbage"] / "s.txt")])
    cases.append(["schedule", _junk(rng)])

    for bad in ("0", "-1", "x"):
        cases.append(["run", "--nproc", bad, str(files["garbage"])])
    cases += [["run", "--nproc", "1", str(files["missing"])], ["run", "--nproc", "1", str(files["dir"])],
              ["run", "--nproc", "1", "--timeout-s", "x", str(files["garbage"])], ["config", "extra"]]

    for flags in (["--tokens", "-1"], ["--tokens", "x"], ["--temperature", "nan"], ["--temperature", "-1"],
                  ["--top-k", "-1"], ["--seed", "-1"], ["--seed", str(2**64)], ["--num-samples", "0"]):
        cases.append(["sample", str(env.run), *flags])
    for name in ("missing", "dir", "garbage"):
        cases.append(["sample", str(files[name])])
        cases.append(["export", str(files[name]), "--out", str(env.tmp / "export")])
    cases += [["export", str(env.run)], ["export", str(env.run), "--out", str(env.run)],
              ["export", str(env.run), "--out", str(files["garbage"])]]
    for name in ("missing", "dir", "garbage", "deep"):
        cases.append(["sweep", "--config", str(files[name])])
    cases += [["sweep", "status", str(files["missing"])], ["sweep", "status", str(files["dir"])],
              ["sweep", _junk(rng)], [_junk(rng)], ["--" + _junk(rng)], ["train", "--" + _junk(rng)]]
    return cases


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang(f"no answer within {PER_CASE_S} s")


def _run_in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PER_CASE_S)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out = capsys.readouterr()
    return code, out.out, out.err


def _problem(code: int, out: str, err: str) -> str | None:
    """What is wrong with an answer to bad input; None when it is one clean line with exit code 2."""
    errors = [line for line in err.splitlines() if line.startswith("stratum: error: ")]
    if code != 2:
        return f"exit code {code}"
    if "Traceback" in out + err:
        return "a traceback"
    if len(errors) != 1:
        return f"{len(errors)} error lines"
    if err.strip().splitlines()[-1] != errors[0]:
        return "stderr does not end with the error line"
    return None


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def env(corpus_file, cache_dir, tmp_path_factory) -> Env:
    tmp = tmp_path_factory.mktemp("fuzz")
    e = Env(corpus=corpus_file, cache=cache_dir, run=tmp / "existing-run", tmp=tmp)
    assert main(["train", *e.base()]) == 0  # the run every case must leave alone
    return e


def test_generation_is_seeded_and_large(env):
    cases = generate(env)
    assert cases == generate(env) and len(cases) >= 300
    assert {c[0] for c in cases} >= {"train", "profile", "plan", "schedule", "run", "config", "sample", "export",
                                     "sweep"}


def test_bad_inputs_in_process_are_one_line_errors(env, capsys):
    before = _snapshot(env.run)
    capsys.readouterr()
    failures = []
    for argv in generate(env):
        try:
            code, out, err = _run_in_process(argv, capsys)
        except _Hang as e:
            failures.append(f"{argv[:2]} {argv[-2:]}: {e}")
            continue
        if (problem := _problem(code, out, err)) is not None:
            failures.append(f"{argv[0]} … {argv[-2:]}: {problem}: {(err.strip().splitlines() or [''])[-1][:200]}")
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures)
    assert _snapshot(env.run) == before


@pytest.mark.slow
def test_bad_inputs_through_the_real_command(env):
    """A few cases per subcommand family as a user runs them: stderr is what the terminal shows."""
    rng = random.Random(SEED)
    cases = generate(env)
    picked = [rng.choice([c for c in cases if c[0] == cmd]) for cmd in ("train", "schedule", "sample")]
    before = _snapshot(env.run)
    for argv in picked:
        argv = [a for a in argv if "\0" not in a]  # a command line cannot carry NUL
        res = subprocess.run([sys.executable, "-m", "stratum", *argv], capture_output=True, text=True,
                             timeout=PER_CASE_S * 4, errors="replace", env=dict(os.environ, PYTHONUNBUFFERED="1"))
        assert _problem(res.returncode, res.stdout, res.stderr) is None, (argv, res.stderr[-2000:])
    assert _snapshot(env.run) == before
