"""Every generator x P x m produces a valid schedule with the expected shape."""

from __future__ import annotations

import argparse
import json

import pytest

from stratum.errors import StratumError
from stratum.schedule import KINDS, generate, validate, wave_stage_to_rank
from stratum.schedule import cli

PS = (1, 2, 3, 4)
MS = (1, 2, 3, 4, 8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("P", PS)
def test_all_generators_validate(kind, P):
    for m in MS:
        s = generate(kind, ranks=P, microbatches=m, virtual=2, waves=1)
        validate(s)
        assert s.num_ranks == P and s.num_microbatches == m
        n_per_pair = 3 if kind.startswith("zb") else 2
        assert sum(len(a) for a in s.actions) == s.num_stages * m * n_per_pair


@pytest.mark.parametrize("P", (1, 2, 3))
@pytest.mark.parametrize("m", (1, 3, 5))
def test_more_virtual_stages_and_waves(P, m):
    validate(generate("interleaved", ranks=P, microbatches=m, virtual=3))
    for kind in ("wave", "zb-wave"):
        s = generate(kind, ranks=P, microbatches=m, waves=2)
        validate(s)
        assert s.num_stages == 4 * P


def test_wave_placement_is_zig_zag():
    # device i holds stages i, 2P-1-i, 2P+i, 4P-1-i
    assert wave_stage_to_rank(3, 2) == (0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0)
    assert wave_stage_to_rank(1, 1) == (0, 0)


def test_bad_arguments_are_refused():
    with pytest.raises(StratumError, match="ranks must be an integer >= 1"):
        generate("1f1b", ranks=0, microbatches=2)
    with pytest.raises(StratumError, match="microbatches must be an integer >= 1"):
        generate("gpipe", ranks=2, microbatches=0)
    with pytest.raises(StratumError, match="waves must be"):
        generate("wave", ranks=2, microbatches=2, waves=0)
    with pytest.raises(StratumError, match="virtual"):
        generate("interleaved", ranks=2, microbatches=2, virtual=0)
    with pytest.raises(StratumError, match="unknown schedule kind 'pipedream'"):
        generate("pipedream", ranks=2, microbatches=2)


def _cli(argv):
    ap = argparse.ArgumentParser(prog="stratum")
    cli.add_parser(ap.add_subparsers(dest="cmd"))
    return cli.run(ap.parse_args(argv))


def test_cli_show_and_simulate(tmp_path, capsys):
    assert _cli("schedule show --kind wave --ranks 2 --microbatches 2".split()) == 0
    out = capsys.readouterr().out
    assert "rank 0: F0.0 F0.1" in out and "valid" in out
    saved = tmp_path / "w.sched"
    assert _cli(f"schedule show --kind 1f1b --ranks 2 --microbatches 3 --save {saved}".split()) == 0
    trace = tmp_path / "t.json"
    assert _cli(f"schedule simulate --file {saved} --latency 0.1 --trace {trace}".split()) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "SIMULATED" in out
    assert json.loads(trace.read_text())["otherData"]["simulated"] is True


def test_cli_bad_input_raises_stratum_error(tmp_path):
    bad = tmp_path / "bad.sched"
    bad.write_text("stages: 0 1\nmicrobatches: 1\nrank 0: F0.0 B0.0\nrank 1: B1.0 F1.0\n")
    with pytest.raises(StratumError, match="wrong order on rank 1"):
        _cli(f"schedule show --file {bad}".split())
    with pytest.raises(StratumError, match="--latency"):
        _cli("schedule simulate --kind gpipe --ranks 2 --microbatches 2 --latency -1".split())
    with pytest.raises(StratumError, match="profile"):
        _cli(f"schedule simulate --kind gpipe --ranks 2 --profile {tmp_path / 'none.json'}".split())
