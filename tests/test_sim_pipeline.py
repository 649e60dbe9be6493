"""Event simulator: closed-form bubbles, memory, communication, profile costs, trace and PNG export."""

from __future__ import annotations

import json

import pytest

from stratum.errors import StratumError
from stratum.plan.partition import even_partition
from stratum.profile import BlockProfile, Profile
from stratum.schedule.generators import generate, gpipe, interleaved, one_f_one_b, wave, zb_1f1b
from stratum.sim.pipeline import Costs, simulate
from stratum.sim.trace import write_chrome_trace, write_png


def _unit(s, **kw):
    v = s.num_stages // s.num_ranks
    return simulate(s, Costs.unit(s.num_stages, stages_per_rank=v, **kw))


@pytest.mark.parametrize("P", (1, 2, 3, 4))
@pytest.mark.parametrize("m", (1, 2, 3, 4, 8))
def test_gpipe_and_1f1b_closed_form(P, m):
    for s in (gpipe(P, m), one_f_one_b(P, m)):
        r = _unit(s)
        assert r.bubble == pytest.approx((P - 1) / (m + P - 1))
        assert r.makespan == pytest.approx(3 * (m + P - 1))


@pytest.mark.parametrize("P, m, v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3), (4, 8, 4), (1, 3, 2)])
def test_interleaved_closed_form(P, m, v):
    r = _unit(interleaved(P, m, v))  # per-stage F = 1/v, B = 2/v
    assert r.bubble == pytest.approx((P - 1) / (v * m + P - 1))


def test_peak_activations_1f1b_vs_gpipe():
    P, m = 4, 8
    g, o = _unit(gpipe(P, m)), _unit(one_f_one_b(P, m))
    assert g.peak_act[0] == pytest.approx(m)
    assert o.peak_act[0] == pytest.approx(P)
    assert o.peak_act == pytest.approx([P - r for r in range(P)])
    assert all(a <= b for a, b in zip(o.peak_act, g.peak_act))


def test_split_backward_holds_activation_until_w():
    r = _unit(zb_1f1b(2, 4))
    assert max(r.peak_act) <= 2 + 1e-9  # ZB-H1 keeps 1F1B's bound
    assert r.makespan < _unit(one_f_one_b(2, 4)).makespan


def test_communication_costs_and_local_hand_off():
    s = one_f_one_b(2, 1)
    r = simulate(s, Costs.unit(2, out_bytes=100.0, latency=0.5, bandwidth=100.0))
    # F0 [0,1], message 1.5 s, F1 [2.5,3.5], B1 [3.5,5.5], message 1.5 s, B0 [7,9]
    assert r.makespan == pytest.approx(9.0)
    assert r.bubble == pytest.approx(1 - 6 / 18)
    w = wave(1, 2, 1)  # P = 1: every hand-off is local, messages cost nothing
    assert simulate(w, Costs.unit(2, stages_per_rank=2, latency=10.0)).makespan == pytest.approx(6.0)


def test_records_are_consistent():
    r = _unit(generate("zb-wave", ranks=3, microbatches=4, waves=1))
    assert len(r.records) == sum(len(a) for a in r.schedule.actions)
    assert sum(x.end - x.start for x in r.records) == pytest.approx(sum(r.busy))
    for rank in range(3):
        mine = [x for x in r.records if x.rank == rank]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))


def _profile(n_blocks: int) -> Profile:
    blocks = [BlockProfile(index=k, name=f"layer.{k}", kind="Layer", n_params=10, param_bytes=40, grad_bytes=40,
                           optim_bytes=80, act_saved_bytes=1000 * (k + 1), out_bytes=512, fwd_s=0.01 * (k + 1),
                           bwd_s=0.02 * (k + 1), bwd_input_s=0.01 * (k + 1)) for k in range(n_blocks)]
    return Profile(model="toy", device="cpu", dtype="float32", precision="fp32", micro_batch=1, seq_len=8,
                   runs=3, blocks=blocks)


def test_costs_from_profile(tmp_path):
    prof = _profile(4)
    c = Costs.from_profile(prof, [range(0, 1), (1, 4)], latency=1e-3, bandwidth=1e9)
    assert c.f == pytest.approx((0.01, 0.09)) and c.b == pytest.approx((0.02, 0.18))
    assert c.i == pytest.approx((0.01, 0.09)) and c.w == pytest.approx((0.01, 0.09))
    assert c.act_bytes == (1000.0, 9000.0) and c.out_bytes == (512.0, 512.0)
    assert c.message_s(512) == pytest.approx(1e-3 + 512e-9)
    assert even_partition(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(StratumError, match="contiguously"):
        Costs.from_profile(prof, [(0, 2), (3, 4)])
    with pytest.raises(StratumError, match="covers blocks 0..2"):
        Costs.from_profile(prof, [(0, 3)])
    r = simulate(one_f_one_b(2, 4), c)
    assert r.makespan > 4 * 0.27 and 0 < r.bubble < 1
    with pytest.raises(StratumError, match="costs are for 2 stages"):
        simulate(gpipe(3, 2), c)


def test_chrome_trace_one_event_per_action(tmp_path):
    r = _unit(interleaved(2, 4, 2))
    path = tmp_path / "trace.json"
    write_chrome_trace(r, path)
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(len(a) for a in r.schedule.actions)
    assert {e["tid"] for e in xs} == {0, 1}
    assert data["otherData"]["simulated"] is True


def test_png_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    write_png(_unit(zb_1f1b(2, 3)), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
