"""sweep.shard_blocks = 0: each sharded-lrtf job's shards are the most blocks whose parameters and gradients fit in
half its device budget, cut as the shard worker cuts them (from the first block, every g blocks)."""

from __future__ import annotations

import math
import random

import pytest

from stratum.config import Config, config_from_dict
from stratum.errors import StratumError
from stratum.profile.profile import BlockProfile, Profile
from stratum.sweep.predict import job_profiles
from stratum.sweep.setup import open_sweep
from stratum.sweep.shard_run import shard_jobs
from stratum.sweep.shard_size import AUTO, device_shard_blocks, fitting_shard_blocks, job_shard_blocks
from stratum.sweep.spec import SweepSettings, load_sweep
from stratum.units import parse_budget
from tests.test_sweep_run import sweep_file
from tests.test_sweep_shards import BUDGET

SHARDED = f'scheduler = "sharded-lrtf"\ndevice_budget = "{BUDGET}"'


def _profile(sizes: list[int], act: int = 0) -> Profile:
    """Blocks of ``sizes`` bytes of parameters (as many of gradients), ``act`` bytes of activations each."""
    blocks = [BlockProfile(index=i, name=f"b{i}", kind="X", n_params=s // 4, param_bytes=s, grad_bytes=s,
                           optim_bytes=2 * s, act_saved_bytes=act, out_bytes=0, fwd_s=1.0, bwd_s=2.0,
                           bwd_input_s=1.0) for i, s in enumerate(sizes)]
    return Profile(model="toy", device="cpu", dtype="float32", precision="fp32", micro_batch=1, seq_len=1, runs=1,
                   blocks=blocks)


@pytest.mark.parametrize(("budget", "want"), [
    (None, 5),  # no budget: one shard
    (320, 5),  # half = 160: the whole model (20 + 40 + 40 + 40 + 20)
    (300, 4),  # half = 150: [0:4] = 140, [4:5] = 20
    (200, 3),  # half = 100: [0:4] = 140 does not fit; [0:3] = 100, [3:5] = 60
    (160, 2),  # half = 80: [0:3] = 100 does not; [0:2] = 60, [2:4] = 80, [4:5] = 20
    (100, 1),  # half = 50: [2:4] = 80 does not; one block is at most 40
    (1, 1),  # nothing fits: one block per shard all the same
])
def test_the_most_blocks_that_fit_half_the_budget(budget, want):
    # parameter bytes 10, 20, 20, 20, 10, gradients as many: shard bytes per block 20, 40, 40, 40, 20
    assert fitting_shard_blocks(_profile([10, 20, 20, 20, 10]), budget) == want


def test_the_choice_is_the_brute_force_largest_on_random_models():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(1, 12))]
        budget = rng.randint(1, 4 * sum(sizes))
        fits = [g for g in range(1, len(sizes) + 1)
                if all(2 * sum(sizes[i:i + g]) <= budget / 2 for i in range(0, len(sizes), g))]
        assert fitting_shard_blocks(_profile(sizes), budget) == max(fits, default=1), (sizes, budget)


def test_a_device_holds_the_activations_beside_two_shards():
    # 5 blocks of 2 × 10 bytes and 10 bytes of activations each: a 90-byte device leaves 40 for two shards
    assert device_shard_blocks(_profile([10] * 5, act=10), 90) == 1
    assert device_shard_blocks(_profile([10] * 5, act=10), 130) == 2  # 80 left: shards of 40
    assert device_shard_blocks(_profile([10] * 5, act=10), 10) == 1  # nothing left


def test_a_job_s_budget_as_typed_decides():
    prof = _profile([10, 20, 20, 20, 10])
    cfg = _config("200")  # bytes
    assert job_shard_blocks(prof, cfg, AUTO) == 3
    assert job_shard_blocks(prof, cfg, 2) == 2  # a number given is the number used
    # a percentage of the training state (parameters 80 bytes, gradients 80, moments 160: 320 bytes)
    assert job_shard_blocks(prof, _config("100%"), AUTO) == 5
    assert job_shard_blocks(prof, _config("50%"), AUTO) == 2
    assert job_shard_blocks(prof, _config(""), AUTO) == 5  # no budget


def _config(budget: str) -> Config:
    return config_from_dict({"offload": {"device_budget": budget}})


def test_the_setting_is_0_or_more(tmp_path, corpus_file, cache_dir):
    assert SweepSettings().shard_blocks == AUTO
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep=SHARDED + "\nshard_blocks = -1",
                      grid='"optim.lr" = [1e-3]', steps=1)
    with pytest.raises(StratumError, match="shard_blocks must be ≥ 1, or 0"):
        load_sweep(path)


def test_each_job_of_a_sweep_gets_what_fits_its_budget(tmp_path, corpus_file, cache_dir):
    """Jobs of two sequence lengths (one parameter count): each job's shard worker chain is cut in the shards
    its budget holds, and its task count follows."""
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep=SHARDED, grid='"optim.lr" = [1e-3, 2e-3]', steps=3)
    sweep = open_sweep(path, say=lambda _: None)
    profiles = job_profiles(sweep.configs, threads=1, cache_dir=tmp_path / "profiles")
    jobs = shard_jobs(sweep.state, sweep.configs, profiles, lambda _: {"plain": 6.0}, AUTO, None)
    budget = parse_budget(BUDGET, "budget")
    for job in jobs:
        prof = profiles[job.id]
        want = fitting_shard_blocks(prof, budget)
        assert 1 < want < len(prof.blocks)  # (the budget holds some blocks, not all: a real choice)
        assert job.shard_blocks == want
        assert job.tasks_left == 3 * 2 * math.ceil(len(prof.blocks) / want) * sweep.configs[job.id].micro_batches_per_step


def test_a_resumed_sharded_sweep_predicts_from_the_seconds_its_jobs_held_slots(tmp_path):
    """A job's wall step time under sharded-lrtf holds the other jobs' tasks too: the earlier workers' task log
    gives the seconds its steps held slots (median task × tasks a step), and the prediction uses those (a killed
    worker's half-written last line left out)."""
    import json

    from stratum.sweep.predict import make_predict
    from stratum.sweep.shard_run import slot_step_seconds
    from stratum.sweep.state import SweepState
    records = [{"t": 0.0, "slot": 0, "job": "j000", "task": 0}, {"t": 0.0, "slot": 1, "job": "j001", "task": 0},
               {"t": 0.5, "slot": 0, "job": "j000", "task": 1}, {"t": 1.0, "slot": 0, "job": "j000", "task": 2}, {"t": 2.0, "slot": 1, "job": "j000", "task": 3},
               {"t": 2.5, "slot": 0, "job": "j001", "end": True}, {"t": 3.0, "slot": 1, "job": "j000", "end": True}]
    (tmp_path / "shard_tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"t": 3.5, "sl')
    cfg = config_from_dict({"train": {"steps": 10, "grad_accum": 2}})
    profiles = {"j000": _profile([20, 40, 40, 40]), "j001": _profile([20, 40, 40, 40])}
    # 2 blocks a task: 2 groups × (forward, backward) × 2 micro-batches = 8 tasks a step
    got = slot_step_seconds(tmp_path, {"j000": cfg, "j001": cfg}, profiles, shard_blocks=2)
    assert got == {"j000": 1.0 * 8}  # j000's tasks 0.5, 0.5, 1.5, 1.0: median 1.0; j001 ran one task (0 → 2)
    state = SweepState(tmp_path / "sw")
    state.add_jobs([("j000", 0, "a", 10), ("j001", 1, "b", 10)])
    state.update("j000", step=4)
    predict = make_predict(state, {"j000": cfg, "j001": cfg}, profiles, slot_step_s=got)
    assert predict("j000") == {"plain": 8.0 * 6}  # its 6 steps left at its slot seconds
    profiled = 2 * sum(b.fwd_s + b.bwd_s for b in profiles["j001"].blocks)
    assert predict("j001")["plain"] == pytest.approx(profiled * (8.0 / profiled) * 10)  # scaled as the ran ones
