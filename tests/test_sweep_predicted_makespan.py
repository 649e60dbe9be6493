"""The predicted makespan's pieces: the give-back rule it plays out per device, planned's plan as a schedule
(the whole, through real sweeps: tests/test_sweep_run.py (fifo), tests/test_sweep_shards.py (sharded-lrtf))."""

from __future__ import annotations

from stratum.sweep.gang_plan import Option
from stratum.sweep.predicted_makespan import give_back, plan_sim
from stratum.sweep.slot_scheduler import UNLIMITED, DeviceMemory


def test_give_backs_are_played_out_for_the_slots_of_one_device_only():
    seconds = {"a": 0.5}
    one = give_back(DeviceMemory(capacity=[300, 300], budget=100), seconds)
    assert one is not None and (one.capacity, one.budget, one.seconds) == (300, 100, seconds)
    unlimited = give_back(UNLIMITED, seconds)
    assert unlimited is not None and unlimited.capacity is None and unlimited.keeps(5, 2)
    assert give_back(DeviceMemory(capacity=[300, 400], budget=100), seconds) is None  # two devices


def test_planned_s_plan_is_the_schedule_it_predicts():
    # a (4 s alone, or 2.5 s over both slots) and b (3 s) on 2 slots: a on both then b (5.5 s) loses to a and b
    # side by side (4 s)
    sim = plan_sim({"a": {"local": Option(seconds=4.0), "replicate(2)": Option(seconds=2.5, devices=2)},
                    "b": {"local": Option(seconds=3.0)}}, 2, 5.0)
    assert sim.makespan == 4.0
    assert sorted((j, e - b) for b, _, j, e in sim.runs) == [("a", 4.0), ("b", 3.0)]
    assert sim.utilisation == (4.0 + 3.0) / (2 * 4.0)
