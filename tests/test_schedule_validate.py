"""The validator rejects broken schedules with the reason, and derives the point-to-point messages."""

from __future__ import annotations

import pytest

from stratum.errors import StratumError
from stratum.schedule.generators import interleaved, one_f_one_b, wave
from stratum.schedule.textio import loads
from stratum.schedule.validate import channel_order_mismatches, comm_plan, messages, validate

GOOD = "stages: 0 1\nmicrobatches: 2\nrank 0: {r0}\nrank 1: {r1}\n"
R0 = "F0.0 F0.1 B0.0 B0.1"
R1 = "F1.0 B1.0 F1.1 B1.1"


def _check(r0: str = R0, r1: str = R1) -> None:
    validate(loads(GOOD.format(r0=r0, r1=r1), check=False))


def test_good_schedule_passes():
    _check()


@pytest.mark.parametrize("r0, r1, reason", [
    ("F0.0 F0.1 B0.0", R1, "missing action B0.1"),
    ("F0.0 F0.1 B0.0 B0.1 B0.1", R1, r"duplicate action\(s\) B0.1 \(2 times\)"),
    ("F0.0 F0.1 B0.0 B0.1 F1.0", "B1.0 F1.1 B1.1", "action F1.0 is on rank 0, but stage 1 belongs to rank 1"),
    ("B0.0 F0.0 F0.1 B0.1", R1, r"wrong order on rank 0: B0.0 \(position 0\) comes before F0.0"),
    ("F0.0 F0.1 B0.0 B0.1", "F1.0 B1.0 F1.1 B1.1 F1.2", "names micro-batch 2"),
    ("F0.0 F0.1 B0.0 I0.1 W0.1 B0.1", R1, "has both B and I/W"),
    ("F0.0 F0.1 B0.0 I0.1", R1, "missing action W0.1"),
])
def test_rejections_name_the_reason(r0, r1, reason):
    with pytest.raises(StratumError, match=reason):
        _check(r0, r1)


def test_deadlock_reports_stuck_ranks():
    # rank 0 waits for B1.0's gradient before sending F0.1; rank 1 wants F1.1 (needs F0.1) before B1.0.
    with pytest.raises(StratumError, match=r"deadlock: rank 0 at B0.0 waits for B1.0 on rank 1; "
                                           r"rank 1 at F1.1 waits for F0.1 on rank 0"):
        _check("F0.0 B0.0 F0.1 B0.1", "F1.0 F1.1 B1.0 B1.1")


def test_a_knob_the_kind_ignores_is_not_counted_against_its_size(capsys):
    """1F1B reads neither --virtual nor --waves: a large value of either leaves it as small as it is."""
    from stratum.cli import main

    assert main(["schedule", "validate", "--kind", "1f1b", "--ranks", "4", "--microbatches", "8",
                 "--virtual", "100000", "--waves", "100000"]) == 0
    assert "valid" in capsys.readouterr().out


def test_rank_without_stage_is_refused():
    with pytest.raises(StratumError, match=r"rank\(s\) \[1\] hold no stage"):
        validate(loads("stages: 0\nranks: 2\nmicrobatches: 1\nrank 0: F0.0 B0.0", check=False))


def test_messages_and_local_hand_off():
    s = one_f_one_b(2, 2)
    msgs = [str(t) for t in messages(s)]
    assert msgs == ["act[0->1].0 r0->r1", "act[0->1].1 r0->r1", "grad[1->0].0 r1->r0", "grad[1->0].1 r1->r0"]
    plan = comm_plan(wave(2, 1, 1))  # stages 0,3 on rank 0; 1,2 on rank 1
    f1 = next(ac for ac in plan[1] if str(ac.action) == "F1.0")
    assert [str(t) for t in f1.recv] == ["act[0->1].0 r0->r1"]
    assert [str(t) for t in f1.send] == ["act[1->2].0 r1->r1 (local)"]
    f0 = next(ac for ac in plan[0] if str(ac.action) == "F0.0")
    assert f0.recv == () and len(f0.send) == 1
    b3 = next(ac for ac in plan[0] if str(ac.action) == "B3.0")
    assert b3.recv == () and [str(t) for t in b3.send] == ["grad[3->2].0 r0->r1"]


def test_fifo_channel_check_runs():
    assert channel_order_mismatches(one_f_one_b(3, 4)) == []
    assert isinstance(channel_order_mismatches(interleaved(2, 4, 2)), list)
