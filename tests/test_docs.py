"""docs/*.md still say what the code does, checked in seconds without training anything.

- Every ``stratum …`` command of the docs' fenced blocks parses as written: ``stratum``'s own argparse accepts it,
  every ``--set key=value`` names a config key with a value of its type (the whole config validated, as
  ``stratum train`` does before it starts anything), a ``--config`` / ``--hardware`` file of the repository exists
  and loads, and a command the doc shows failing fails with the doc's ``stratum: error:`` line. Commands run in a
  scratch directory laid out like a checkout, where the files earlier commands of the same doc write
  (``--out``, ``--save``) exist, as a reader's would.
- Every config snippet loads: a ``[hardware]`` table as a hardware spec, a ``[sweep]`` file as a sweep, any other
  TOML as a training config, and lines ``section.key = value`` as ``--set`` overrides.
- Every reference in inline code of the docs and README.md exists: config keys (``train.steps``, ``sweep.slots``),
  module paths (``stratum.plan.partition.stage_costs``), repository files, the flags of ``stratum`` commands and of
  ``python benchmarks/….py`` runs.

README.md's commands are run for real by test_readme.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import re
from pathlib import Path

import pytest
from doc_blocks import command_lines, fenced_blocks, stratum_argv

from stratum.cli import build_parser
from stratum.config import MOVED, SECTIONS, load_config
from stratum.errors import StratumError
from stratum.ir.hardware import load_hardware
from stratum.sweep.spec import SweepSettings, load_sweep

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
LINKED = ("benchmarks", "configs", "docs", "examples", "src", "tests")
SHELL = ("bash", "sh", "console", "text", "")
OUTPUTS = ("--out", "--save", "--json", "--png", "--trace")
"""Options whose value is a file the command writes (later commands of the doc may read it)."""
NOT_KEYS = {"optim.lrr": "sweep.md's example of the error an unknown key gives"}
EXTENSIONS = ("py", "md", "toml", "json", "csv", "txt", "sh", "png", "log", "xml", "db", "jsonl")


def doc_commands() -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    """(doc, command, the ``stratum: error:`` line the doc shows it printing or None, the files earlier
    commands of the doc wrote) for every ``stratum`` command in the docs' fenced blocks."""
    out = []
    for path in DOCS:
        written: list[str] = []
        for lang, body in fenced_blocks(path.read_text()):
            if lang not in SHELL:
                continue
            lines = command_lines(body)
            for i, line in enumerate(lines):
                argv = stratum_argv(line)
                if argv is None:
                    continue
                after = lines[i + 1] if i + 1 < len(lines) else ""
                error = after.removeprefix("stratum: error: ") if after.startswith("stratum: error: ") else None
                out.append((path.name, line, error, tuple(written)))
                written += [v for k, v in zip(argv, argv[1:]) if k in OUTPUTS]
    return out


COMMANDS = doc_commands()


def test_the_docs_have_commands_and_each_is_found():
    assert len(COMMANDS) >= 20
    assert {doc for doc, *_ in COMMANDS} >= {"cluster.md", "offload.md", "parallel.md", "pipeline.md",
                                              "plan_search.md", "sweep.md"}
    assert stratum_argv("torchrun --nproc_per_node 4 -m stratum train --set a.b='c d'") == ["train", "--set",
                                                                                           "a.b=c d"]
    assert stratum_argv("$ stratum plan --x [--hardware hw.toml] …") == ["plan", "--x", "--hardware", "hw.toml"]
    assert stratum_argv("OMP_NUM_THREADS=1 stratum train") == ["train"] and stratum_argv("make train") is None
    assert command_lines("a \\\n    --b  # c\n# d\n\ne\n") == ["a --b", "e"]


def parse(argv: list[str]):
    """``stratum``'s parse of argv; a usage error fails the test with argparse's line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"stratum {' '.join(argv)}: {err.getvalue().strip()}")


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("doc, command, error, written", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c, *_ in COMMANDS])
def test_doc_command_parses(doc, command, error, written, checkout):
    for name in written:
        (checkout / name).touch()
    argv = stratum_argv(command)
    assert argv is not None
    args = parse(argv)
    for value in argv:
        if value.split("/")[0] in LINKED:
            assert Path(value).exists(), f"{doc}: {command}: {value} does not exist"
    if getattr(args, "config", None):
        assert Path(args.config).is_file(), f"{doc}: {command}: no {args.config}"
    if args.command == "sweep" and args.config:
        load_sweep(args.config)
    if getattr(args, "hardware", None) and Path(args.hardware).is_file() and args.hardware not in written:
        load_hardware(args.hardware)
    if not hasattr(args, "overrides"):
        assert error is None
        return
    if error is None:
        load_config(args.config, args.overrides)
    else:
        with pytest.raises(StratumError) as e:
            load_config(args.config, args.overrides)
        assert str(e.value) == error


SETTING = re.compile(r"(\w+)\.(\w+)\s*=\s*(.+?)(?:\s+#.*)?")


def config_snippets() -> list[tuple[str, int, str, str]]:
    """(doc, index, language, body) of the fenced blocks that are configs: TOML, or lines of ``section.key =
    value``."""
    out = []
    for path in DOCS:
        for i, (lang, body) in enumerate(fenced_blocks(path.read_text())):
            lines = [line for line in body.splitlines() if line.strip() and not line.startswith("#")]
            if lang == "toml" or (lang == "" and lines and all(SETTING.fullmatch(line) for line in lines)):
                out.append((path.name, i, lang, body))
    return out


SNIPPETS = config_snippets()


@pytest.mark.parametrize("doc, index, lang, body", SNIPPETS, ids=[f"{d}:block{i}" for d, i, *_ in SNIPPETS])
def test_doc_config_snippet_loads(doc, index, lang, body, tmp_path):
    path = tmp_path / "snippet.toml"
    path.write_text(body)
    if lang != "toml":
        for line in body.splitlines():
            if m := SETTING.fullmatch(line):
                load_config(None, [f"{m[1]}.{m[2]}={m[3]}"])
    elif re.search(r"^\[hardware\]", body, flags=re.M):
        load_hardware(path)
    elif re.search(r"^\[sweep\]", body, flags=re.M):
        load_sweep(path)
    else:
        load_config(path)


def test_the_docs_have_config_snippets():
    assert {(doc, lang) for doc, _, lang, _ in SNIPPETS} >= {("offload.md", "toml"), ("plan_search.md", "toml"),
                                                            ("sweep.md", "toml"), ("burst.md", "")}


KEYS = {section: {f.name for f in dataclasses.fields(cls)} for section, cls in SECTIONS.items()}
KEYS["sweep"] = {f.name for f in dataclasses.fields(SweepSettings)} | {"grid", "random"}
KEY = re.compile(rf"(?<![\w.\-'/])({'|'.join(KEYS)})\.([a-z_]\w*)\b(?![./(])")
MODULE = re.compile(r"(?<![\w./])stratum(?:\.\w+)+")
FILE = re.compile(rf"(?<![\w./-])(?:src/)?(?:stratum|{'|'.join(LINKED)})/[\w./-]+\.(?:py|toml|md|json|sh|txt)\b")
BENCH = re.compile(r"(?:python|bash) (benchmarks/[\w./-]+\.(?:py|sh))((?: [^`]*)?)")


def inline_code(text: str) -> list[str]:
    """The inline code spans of a Markdown text (outside its fenced blocks)."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.M | re.S))


def resolves(path: str) -> bool:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def stratum_flags_missing(span: str) -> list[str]:
    """The ``--flags`` of an inline ``stratum <command> …`` that its (sub)command does not take."""
    words = re.sub(r"[\[\]]", " ", span.split("  #")[0]).split()[1:]
    if any(w.endswith(".py") for w in words):  # stratum run …: what follows the script is the script's
        words = words[:next(i for i, w in enumerate(words) if w.endswith(".py"))]
    parser = build_parser()
    while words and parser._subparsers is not None:
        choices = next(a.choices for a in parser._subparsers._group_actions)
        word = words[0].split("|")[0]
        if word not in choices:
            break
        parser = choices[word]
        words.pop(0)
    options = {o for a in parser._actions for o in a.option_strings}
    return [w for w in words if w.startswith("--") and w.split("=")[0] not in options]


@pytest.mark.parametrize("doc", [*DOCS, REPO / "README.md"], ids=lambda p: p.name)
def test_doc_references_exist(doc):
    wrong = []
    text = doc.read_text()
    spans = inline_code(text)
    for code in spans + [line for _, body in fenced_blocks(text) for line in body.splitlines()]:
        for m in KEY.finditer(code):
            if m[2] not in KEYS[m[1]] and m[0] not in NOT_KEYS and m[0] not in MOVED and m[2] not in EXTENSIONS:
                wrong.append(f"config key {m[0]} (`stratum config` lists the keys)")
        wrong += [f"module path {m[0]}" for m in MODULE.finditer(code) if not resolves(m[0])]
        wrong += [f"file {m[0]}" for m in FILE.finditer(code)
                  if not (REPO / m[0]).exists() and not (REPO / "src" / m[0]).exists()]
        if code in spans and code.startswith("stratum "):
            wrong += [f"`{code}`: no {flag}" for flag in stratum_flags_missing(code)]
        for m in BENCH.finditer(code):
            script = REPO / m[1]
            source = script.read_text() if script.is_file() else ""
            wrong += [f"`{m[0]}`: {m[1]} has no {flag}" for flag in re.findall(r"(?<!\S)--[\w-]+", m[2])
                      if f'"{flag}"' not in source]
    assert not wrong, f"{doc.name}: " + "; ".join(sorted(set(wrong)))


def test_sweep_md_lists_every_sweep_key_with_its_default():
    """docs/sweep.md's table of ``[sweep]`` keys: one row per key of SweepSettings, with its default."""
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(SweepSettings)}
    listed = {}
    for keys, values in re.findall(r"^\| (`\w+`(?:, `\w+`)*) \| ([^|]*) \|", (REPO / "docs" / "sweep.md").read_text(),
                                   flags=re.M):
        names, shown = re.findall(r"`(\w+)`", keys), [v.strip().strip("`") for v in values.split(",")]
        listed.update(zip(names, shown if len(shown) == len(names) else [values.strip()] * len(names)))
    assert set(listed) == set(defaults)
    for key, shown in listed.items():
        default = defaults[key]
        if isinstance(default, str):
            assert shown.strip('"') == default, key
        elif isinstance(default, list):
            assert shown == "[]" and default == [], key
        else:
            assert float(shown) == default, key
