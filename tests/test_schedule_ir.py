"""Schedule IR: notation, tables, text round trip."""

from __future__ import annotations

import pytest

from stratum.errors import StratumError
from stratum.schedule.generators import gpipe, interleaved, one_f_one_b, wave, zb_1f1b, zb_wave
from stratum.schedule.ir import Action, B, F, Schedule
from stratum.schedule.textio import dumps, load, loads, save


def _table(*rows: str) -> str:
    return "\n".join(rows)


def test_action_notation_round_trips():
    a = Action.parse("F3.1")
    assert a == F(3, 1) and str(a) == "F3.1"
    with pytest.raises(StratumError, match="KIND STAGE.MB"):
        Action.parse("X1.2")
    with pytest.raises(StratumError, match="not one of"):
        Action("Q", 0, 0)


def test_schedule_is_frozen_and_checks_shape():
    s = one_f_one_b(2, 2)
    with pytest.raises(AttributeError):
        s.name = "other"  # type: ignore[misc]
    with pytest.raises(StratumError, match="mapped to rank 5"):
        Schedule(name="x", stage_to_rank=[0, 5], num_microbatches=1, actions=[[], []])
    assert s.num_stages == 2 and s.num_ranks == 2 and s.num_microbatches == 2


def test_table_gpipe_p2_m2():
    assert gpipe(2, 2).table() == _table(
        "rank 0: F0.0 F0.1 .    .    B0.1 B0.0",
        "rank 1: .    F1.0 F1.1 B1.1 B1.0 .",
    )


def test_table_1f1b_p2_m3():
    assert one_f_one_b(2, 3).table() == _table(
        "rank 0: F0.0 F0.1 .    B0.0 F0.2 B0.1 .    B0.2",
        "rank 1: .    F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 .",
    )


def test_table_interleaved_p2_v2_m2():
    assert interleaved(2, 2, 2).table() == _table(
        "rank 0: F0.0 F0.1 F2.0 F2.1 .    B2.0 .    B2.1 B0.0 B0.1",
        "rank 1: .    F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1 .",
    )


def test_table_wave_p2_w1_m2():
    s = wave(2, 2, 1)
    assert s.stage_to_rank == (0, 1, 1, 0)  # zig-zag: the turn (stages 1->2) stays on rank 1
    assert s.table() == _table(
        "rank 0: F0.0 F0.1 .    F3.0 B3.0 F3.1 B3.1 B0.0 .    B0.1",
        "rank 1: .    F1.0 F2.0 F1.1 F2.1 B2.0 B1.0 B2.1 B1.1 .",
    )


def test_table_zb_1f1b_p2_m2():
    assert zb_1f1b(2, 2).table() == _table(
        "rank 0: F0.0 F0.1 .    I0.0 W0.0 .    I0.1 W0.1",
        "rank 1: .    F1.0 I1.0 W1.0 F1.1 I1.1 W1.1 .",
    )


@pytest.mark.parametrize("sched", [gpipe(3, 4), interleaved(2, 3, 2), zb_wave(2, 3, 1)], ids=lambda s: s.name)
def test_text_round_trip(sched, tmp_path):
    assert loads(dumps(sched)) == sched
    path = tmp_path / "s.sched"
    save(sched, path)
    assert load(path) == sched


def test_text_format_hand_written_and_errors(tmp_path):
    text = """
    # a hand-written 1F1B
    name: mine
    stages: 0 1
    microbatches: 2
    rank 0: F0.0 F0.1, B0.0
    rank 0: B0.1          # continues rank 0
    rank 1: F1.0 B1.0 F1.1 B1.1
    """
    s = loads(text)
    assert s.name == "mine" and s.actions[0] == (F(0, 0), F(0, 1), B(0, 0), B(0, 1))
    with pytest.raises(StratumError, match="missing 'stages:'"):
        loads("microbatches: 1\nrank 0: F0.0 B0.0")
    with pytest.raises(StratumError, match=r"<text>:2: cannot read action 'G0.0'"):
        loads("stages: 0\nrank 0: G0.0 B0.0\nmicrobatches: 1")
    with pytest.raises(StratumError, match="missing action B0.0"):
        loads("stages: 0\nmicrobatches: 1\nrank 0: F0.0")
    with pytest.raises(StratumError, match="does not exist"):
        load(tmp_path / "nope.sched")
