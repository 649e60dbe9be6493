"""Every generator x P x m produces a valid schedule with the expected shape."""

from __future__ import annotations

import argparse
import json

import pytest

from stratum.errors import StratumError
from stratum.schedule import cli
from stratum.schedule.generators import KINDS, generate, wave_stage_to_rank
from stratum.schedule.validate import validate

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



def test_cli_file_takes_no_generator_flags(tmp_path):
    saved = tmp_path / "g.sched"
    assert _cli(f"schedule show --kind gpipe --ranks 2 --microbatches 2 --save {saved}".split()) == 0
    with pytest.raises(StratumError, match="--kind, --ranks and --file both describe the schedule"):
        _cli(f"schedule show --ranks 4 --kind wave --file {saved}".split())
    with pytest.raises(StratumError, match="is a directory"):
        _cli(f"schedule show --file {tmp_path}".split())
    with pytest.raises(StratumError, match="--waves must be ≥ 1"):
        _cli("schedule show --waves 0".split())

# ---- the wave generators against their baselines (SIMULATED, unit costs) -----------------------------------
def _mk(s, latency=0.0):
    from stratum.sim.pipeline import Costs, simulate

    v = s.num_stages // s.num_ranks
    r = simulate(s, Costs.unit(s.num_stages, stages_per_rank=v, out_bytes=1.0, latency=latency))
    return r.makespan, max(r.peak_act), r.bubble


@pytest.mark.parametrize("P, m", [(2, 4), (4, 4), (4, 8), (3, 6)])
def test_zb_wave_beats_zb_1f1b_with_free_and_costly_messages(P, m):
    zw, z1 = generate("zb-wave", ranks=P, microbatches=m), generate("zb-1f1b", ranks=P, microbatches=m)
    for lat in (0.0, 0.17):   # 0.17 of a rank's forward per message ~ the benchmark's "realistic" link
        a, b = _mk(zw, lat), _mk(z1, lat)
        assert a[0] < b[0], (lat, a, b)
        assert a[1] <= b[1] + 1e-9


@pytest.mark.parametrize("P, m, W", [(2, 4, 1), (4, 8, 1), (4, 8, 2), (3, 5, 2)])
def test_wave_memory_within_interleaved_and_above_the_placement_lower_bound(P, m, W):
    v = 2 * W
    w, i = generate("wave", ranks=P, microbatches=m, waves=W), generate("interleaved", ranks=P, microbatches=m,
                                                                     virtual=v)
    assert _mk(w)[1] <= _mk(i)[1] + 1e-9
    # Any schedule where rank r's first stage is r (zig-zag or interleaved) idles r/v before it starts and
    # 2r/v after its last backward: bubble >= (P-1)/(v m + P-1) with free messages.
    assert _mk(w)[2] >= (P - 1) / (v * m + P - 1) - 1e-9


def test_hand_derived_wave_reaches_the_lower_bound_at_p2_m4():
    """A hand-built zig-zag order (docs/schedules.md): P=2, m=4, W=1 has interleaved v=2's bubble 1/9 at its
    peak activation 2.5, the lower bound (P-1)/(vm+P-1); the wave generator finds the same makespan."""
    from stratum.schedule.textio import loads

    s = loads("name: wave-hand\nstages: 0 1 1 0\nmicrobatches: 4\n"
              "rank 0: F0.0 F0.1 F0.2 F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F0.3 B0.0 B0.1 F3.3 B3.3 B0.2 B0.3\n"
              "rank 1: F1.0 F2.0 F1.1 F2.1 F1.2 B2.0 F2.2 B2.1 B1.0 B1.1 F1.3 F2.3 B2.2 B1.2 B2.3 B1.3\n")
    mk, peak, bubble = _mk(s)
    assert mk == pytest.approx(13.5) and bubble == pytest.approx(1 / 9) and peak == pytest.approx(2.5)
    assert (mk, peak) == pytest.approx(_mk(generate("interleaved", ranks=2, microbatches=4, virtual=2))[:2])
    for W in (1, 2):   # the generator reaches the bound here (and for m >= 2P in general, next test)
        g = _mk(generate("wave", ranks=2, microbatches=4, waves=W))
        assert g[2] == pytest.approx(1 / (2 * W * 4 + 1))


def _zig_zag_bound(P, m, W):
    """Least makespan of any zig-zag schedule with free messages, in units of a rank's forward per micro-batch
    (docs/schedules.md): interleaved's bound, plus the idle of rank P-1 when its 2Wm forward slots cannot fill
    the (2W+1)P-1 slots before its first backward can arrive."""
    v = 2 * W
    return (3 * v * m + 3 * (P - 1) + max(0, (v + 1) * P - 1 - v * m)) / v


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("W", [1, 2])
def test_wave_reaches_the_zig_zag_bound_and_ties_interleaved_from_m_2p(P, W):
    for m in (P, 2 * P, 4 * P):
        w = _mk(generate("wave", ranks=P, microbatches=m, waves=W))
        i = _mk(generate("interleaved", ranks=P, microbatches=m, virtual=2 * W))
        assert w[0] == pytest.approx(_zig_zag_bound(P, m, W)), (m, w)
        assert w[1] <= i[1] + 1e-9
        if m >= 2 * P:   # the bound is interleaved's (P-1)/(vm+P-1); below, the zig-zag is provably worse
            assert w[2] <= i[2] + 1e-9, (m, w, i)
        else:
            assert w[2] > i[2]


@pytest.mark.parametrize("P, m, W", [(2, 8, 1), (4, 8, 1), (4, 16, 1), (2, 8, 2), (4, 8, 2), (4, 16, 2),
                                     (8, 16, 2), (8, 32, 2)])
def test_wave_beats_interleaved_with_costly_messages(P, m, W):
    # 0.17 of a rank's forward per message ~ the benchmark's "realistic" link; the wave's turns are local
    w = _mk(generate("wave", ranks=P, microbatches=m, waves=W), latency=0.17)
    i = _mk(generate("interleaved", ranks=P, microbatches=m, virtual=2 * W), latency=0.17)
    assert w[0] < i[0] and w[1] <= i[1] + 1e-9
