"""Library messages go through the `stratum` logger: the command shows them on a console it removes afterwards,
a user's own handler receives them instead (and nothing is printed twice), other ranks show warnings only."""

from __future__ import annotations

import logging

import pytest

from stratum.cli import main
from stratum.log import LOGGER, console, console_unless_configured
from stratum.train.trainer import train

log = logging.getLogger("stratum.test")


def _logger_state():
    logger = logging.getLogger(LOGGER)
    return list(logger.handlers), logger.level, logger.propagate


def test_the_command_prints_the_trainers_messages_and_restores_the_logger(make_cfg, tmp_path, capsys):
    before = _logger_state()
    cfg = make_cfg("train.steps=2", out=tmp_path / "run")
    argv = ["train", "--set", f"data.corpus={cfg.data.corpus!r}", "--set", f"data.cache_dir={cfg.data.cache_dir!r}",
            "--set", "model.preset='tiny'", "--set", "train.steps=2", "--set", "data.seq_len=32",
            "--set", "train.micro_batch_size=2", "--set", f"train.out_dir={str(tmp_path / 'run')!r}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "model tiny (gpt)" in out and "starting at step 0" in out and "done: 2/2 steps" in out
    assert "step      2/2" in out  # the progress lines (not a terminal) come through the logger too
    assert _logger_state() == before


def test_a_users_handler_receives_the_messages_and_nothing_is_printed(make_cfg, tmp_path, capsys):
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.INFO)
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        train(make_cfg("train.steps=2", out=tmp_path / "run"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    text = [r.getMessage() for r in records]
    assert any(t.startswith("model tiny (gpt)") for t in text) and any(t.startswith("done: 2/2") for t in text)
    assert {r.name for r in records} >= {"stratum.train.trainer", "stratum.train.progress"}
    assert "done:" not in capsys.readouterr().out


def test_unconfigured_logging_gets_the_console_and_other_ranks_see_warnings_only(monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a script that configured nothing
    with console_unless_configured():
        log.info("shown")
        log.warning("careful")
    log.warning("after")  # the console is gone again: logging's own last resort prints this one
    captured = capsys.readouterr()
    assert captured.out == "shown\n"
    assert captured.err.startswith("stratum: warning: careful\n")
    monkeypatch.setenv("RANK", "1")
    with console():
        log.info("rank 1 info")
        log.warning("rank 1 warning")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "stratum: warning: rank 1 warning\n"


def test_nested_consoles_print_once(capsys):
    with console() as outer, console() as inner:
        assert inner is outer
        log.info("once")
    assert capsys.readouterr().out == "once\n"


@pytest.mark.parametrize("level", [logging.ERROR, logging.CRITICAL])
def test_errors_are_prefixed_with_their_level(level, capsys):
    with console():
        log.log(level, "bad")
    assert capsys.readouterr().err == f"stratum: {logging.getLevelName(level).lower()}: bad\n"
