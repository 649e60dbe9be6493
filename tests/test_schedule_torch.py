"""torch.distributed.pipelining's schedules imported into the Schedule IR (kinds ``torch:NAME``), and zb-wave W=1
against torch's ZBV (SIMULATED, unit costs: F = 1, B = 2, I = W = 1 per rank and micro-batch, free messages)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from stratum.errors import StratumError
from stratum.schedule.generators import generate, wave_stage_to_rank
from stratum.schedule.ir import Schedule
from stratum.schedule.textio import dumps, loads
from stratum.schedule.torch_import import TORCH_NAMES, _planned_order, from_torch
from stratum.schedule.validate import validate
from stratum.schedule.vfill import fill_first_order
from stratum.sim.pipeline import Costs, simulate

from test_pipeline_engine import M, _check, build, run_engine, spawn_job, spec

# Closed-form unit-cost makespans (m a multiple of P, v stages per rank): GPipe fills and drains, the 1F1B
# family without split backward ends 3(P-1)/v after 3m, the zero-bubble family on the bound 3m + (P-1)/v (rank
# P-1 cannot start before its P-1 upstream stage forwards, then has 3m of work).
EXPECTED = {
    "GPipe": lambda P, m, v: 3 * (m + P - 1),
    "Interleaved1F1B": lambda P, m, v: 3 * m + 3 * (P - 1) / v,
    "LoopedBFS": lambda P, m, v: 3 * m + 3 * (P - 1) / v,
    "InterleavedZeroBubble": lambda P, m, v: 3 * m + (P - 1) / v,
    "ZBVZeroBubble": lambda P, m, v: 3 * m + (P - 1) / v,
    "DualPipeV": lambda P, m, v: 3 * m + (P - 1) / v,
}


def _sim(s):
    r = simulate(s, Costs.unit(s.num_stages, stages_per_rank=s.num_stages // s.num_ranks))
    return r.makespan, max(r.peak_act), r.bubble


def test_every_exported_torch_schedule_class_has_a_kind():
    exported = {n[len("Schedule"):] for n in torch_schedules.__all__ if n.startswith("Schedule")}
    assert set(TORCH_NAMES) == exported and set(EXPECTED) | {"1F1B"} == exported


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("P, m", [(2, 4), (3, 6), (4, 8)])
def test_imported_schedule_validates_and_simulates_to_its_unit_makespan(name, P, m):
    s = generate(f"torch:{name}", ranks=P, microbatches=m)
    validate(s)
    v = s.num_stages // P
    assert s.name == f"torch:{name}" and s.num_ranks == P and s.num_microbatches == m
    assert _sim(s)[0] == pytest.approx(EXPECTED[name](P, m, v))
    assert loads(dumps(s)) == s  # the text format keeps the torch: name


def test_import_keeps_torchs_order_of_compute_actions():
    """Rank by rank, the imported list is torch's pipeline_order without idle steps, sub-actions inlined."""
    P, m = 3, 6
    for name in ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"):
        order = _planned_order(torch_schedules.get_schedule_class(name), P, m, 2)
        mine = from_torch(name, ranks=P, microbatches=m)
        for r in range(P):
            theirs = [x for a in order[r] if a is not None for x in (a.sub_actions or (a,))
                      if x.computation_type.value in ("F", "B", "I", "W")]
            assert [f"{a.stage}{a.kind}{a.mb}" for a in mine.actions[r]] == [str(x) for x in theirs]


@pytest.mark.parametrize("P, v", [(2, 2), (3, 3), (4, 2), (4, 4)])
def test_stratum_interleaved_is_torchs_interleaved_1f1b(P, v):
    """Megatron's order both ways: at m a multiple of P the two lists agree action for action."""
    for m in (P, 2 * P, 3 * P):
        ours = generate("interleaved", ranks=P, microbatches=m, virtual=v)
        theirs = generate("torch:Interleaved1F1B", ranks=P, microbatches=m, virtual=v)
        assert ours.stage_to_rank == theirs.stage_to_rank and ours.actions == theirs.actions, (P, m, v)


def test_torch_refusals_are_one_line_errors():
    with pytest.raises(StratumError, match="no schedule 'Nope'; choose one of torch:1F1B") as e:
        generate("torch:Nope", ranks=2, microbatches=4)
    with pytest.raises(StratumError, match="torch refuses it") as e2:
        generate("torch:ZBVZeroBubble", ranks=2, microbatches=4, virtual=3)
    with pytest.raises(StratumError, match="torch refuses it"):
        generate("torch:Interleaved1F1B", ranks=2, microbatches=5)
    with pytest.raises(StratumError, match="microbatches must be"):
        generate("torch:GPipe", ranks=2, microbatches=0)
    assert "\n" not in str(e.value) and "\n" not in str(e2.value)


def test_torch_1f1b_imports_or_says_its_list_is_invalid():
    """torch 2.13's Schedule1F1B.pipeline_order starts its last rank at micro-batch 1 (its own runtime does not
    read that list): the import refuses it in one line rather than repair it; a fixed torch gives 1F1B's span."""
    try:
        s = generate("torch:1F1B", ranks=4, microbatches=8)
    except StratumError as e:
        assert "pipeline_order is not a valid schedule" in str(e) and "\n" not in str(e)
    else:
        assert _sim(s)[0] == pytest.approx(3 * (8 + 4 - 1))


def test_cli_shows_and_simulates_a_torch_kind(capsys):
    from stratum.cli import main

    assert main("schedule simulate --kind torch:ZBVZeroBubble --ranks 4 --microbatches 16".split()) == 0
    out = capsys.readouterr().out
    assert "torch:ZBVZeroBubble: 8 stages on 4 ranks" in out and "makespan 49.5 units" in out
    assert main("schedule show --kind torch:nope --ranks 2".split()) == 2
    err = capsys.readouterr().err.strip()
    assert "no schedule 'nope'" in err and "\n" not in err


def test_pipeline_config_accepts_a_torch_kind(make_cfg):
    from stratum.parallel.compose import check_plan

    plan = check_plan(make_cfg("train.engine='pipeline'", "pipeline.schedule='torch:ZBVZeroBubble'",
                               "pipeline.ranks=2", "train.grad_accum=4"), tokenizer_vocab=256)
    assert plan.schedule.name == "torch:ZBVZeroBubble" and plan.schedule.stage_to_rank == (0, 1, 1, 0)


# ---- zb-wave W = 1 against torch's ZBV ------------------------------------------------------------------------
def test_fill_first_order_runs_at_zbvs_memory_and_starves_below_it():
    for P, m in ((1, 3), (2, 1), (3, 5), (4, 8)):
        s2r = wave_stage_to_rank(P, 1)
        order = fill_first_order(s2r, m, 2 * P)
        validate(Schedule(name="fill-first", stage_to_rank=s2r, num_microbatches=m, actions=order))
        assert sum(map(len, order)) == 6 * P * m
    assert fill_first_order(wave_stage_to_rank(4, 1), 8, 7) is None  # the turn's rank fills up with forwards


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4, 8])
def test_zb_wave_w1_never_worse_than_torch_zbv(P):
    """P <= m <= 8P: zb-wave W=1 sits on the bound 3m + (P-1)/2 (so no V schedule is shorter, ZBV included),
    never above ZBV's makespan or peak activation, and its bubble falls with every added micro-batch."""
    prev = 1.0
    for m in range(P, 8 * P + 1):
        mk, peak, bubble = _sim(generate("zb-wave", ranks=P, microbatches=m, waves=1))
        zmk, zpeak, _ = _sim(generate("torch:ZBVZeroBubble", ranks=P, microbatches=m))
        assert mk == pytest.approx(3 * m + (P - 1) / 2), (P, m)
        assert mk <= zmk + 1e-9 and peak <= zpeak + 1e-9, (P, m, mk, zmk, peak, zpeak)
        assert bubble < prev, (P, m)
        prev = bubble


# ---- an imported schedule on two gloo processes ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_imported_torch_schedules_match_the_plain_engine(tmp_path):
    from stratum.runtime.plain import PlainEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        plain = PlainEngine(build("gpt", None), optim=spec(), device=torch.device("cpu"))
        losses = run_engine(plain)
        st = plain.state()
    finally:
        torch.set_num_threads(threads)
    ref = {"losses": losses, "params": st.params, "exp_avg": {n: s["exp_avg"] for n, s in st.optim.items()}}
    names = ("ZBVZeroBubble", "DualPipeV")  # V placement; DualPipeV also inlines OVERLAP_F_B
    cases = [{"name": f"gpt/torch:{n}", "model": "gpt", "kind": f"torch:{n}", "kw": {}} for n in names]
    assert M >= 4  # DualPipeV needs as many micro-batches as stages (4 on 2 ranks)
    results = spawn_job(tmp_path, 2, cases)
    for case in cases:
        _check(results[case["name"]], ref, f"P=2 {case['name']}")
