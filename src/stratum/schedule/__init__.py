"""Pipeline schedules: the Schedule IR, generators, validator, text format and ``stratum schedule`` CLI."""

from stratum.schedule.generators import (
    KINDS,
    generate,
    gpipe,
    interleaved,
    one_f_one_b,
    wave,
    wave_stage_to_rank,
    zb_1f1b,
    zb_wave,
)
from stratum.schedule.ir import Action, Schedule
from stratum.schedule.textio import dumps, load, loads, save
from stratum.schedule.validate import ActionComm, Transfer, comm_plan, messages, validate

__all__ = [
    "KINDS", "Action", "ActionComm", "Schedule", "Transfer", "comm_plan", "dumps", "generate", "gpipe",
    "interleaved", "load", "loads", "messages", "one_f_one_b", "save", "validate", "wave", "wave_stage_to_rank",
    "zb_1f1b", "zb_wave",
]
