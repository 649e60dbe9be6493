"""Hardening (issue 16): help for every command, files that cannot be written, one run per out_dir, corrupt
checkpoints and token caches, numbers and text that make no sense."""

from __future__ import annotations

import argparse

import pytest

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
