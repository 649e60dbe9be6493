"""The planner: budgets respected, overrides honoured, infeasible budgets refused naming the smallest that works;
config and CLI errors are one line; `stratum plan` and the dry run print the plan; the trainer runs it."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from stratum.cli import main
from stratum.data.tokens import Batch
from stratum.errors import StratumError
from stratum.offload.engine import OffloadEngine
from stratum.offload.tiers import DEVICE, DISK, HOST
from stratum.train.trainer import read_metrics, train

from offload_helpers import DEV, B, T, V, build, fixed_times, plan, profile, spec, state_bytes


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planner")
    m = build("gpt", tmp)
    return m, fixed_times(profile(m))


def test_infeasible_budget_names_the_smallest_that_works(gpt):
    m, prof = gpt
    with pytest.raises(StratumError) as e:
        plan(m, prof, device_budget=10_000)
    msg = str(e.value)
    assert "\n" not in msg and "smallest offload.device_budget" in msg
    smallest = int(re.search(r"\(([\d,]+) bytes\)", msg).group(1).replace(",", ""))
    p = plan(m, prof, device_budget=smallest)
    assert p.predicted_peak[DEVICE] <= smallest
    with pytest.raises(StratumError):
        plan(m, prof, device_budget=smallest - 1)


def test_infeasible_host_budget_names_the_smallest_host_budget(gpt):
    from stratum.offload.planner import make_placement
    m, prof = gpt
    with pytest.raises(StratumError, match="smallest offload.host_budget"):
        make_placement(m, device_budget=state_bytes(m) // 4, host_budget=1000, disk_free=0, bandwidths=None,
                  profile=prof)


def test_budgets_are_respected_and_more_budget_is_never_slower(gpt):
    m, prof = gpt
    S = state_bytes(m)
    last = None
    for frac in (0.1, 0.25, 0.5, 2.0):
        p = plan(m, prof, device_budget=int(S * frac))
        assert p.predicted_peak[DEVICE] <= S * frac
        traffic = sum(p.predicted_traffic.values())
        if last is not None:
            assert traffic <= last
        last = traffic
    assert plan(m, prof).param_tier == DEVICE and plan(m, prof).optimizer_tier == DEVICE


def test_overrides_are_honoured(gpt):
    m, prof = gpt
    S = state_bytes(m)
    p = plan(m, prof, device_budget=S // 2, chunk_elems=60_000, resident_chunks=3, optimizer_tier=DISK,
             prefetch_depth=2, activations="recompute")
    # the chunk size is rounded up to a multiple of 4 KiB (direct I/O)
    assert (p.chunk_elems, p.resident_chunks, p.optimizer_tier, p.prefetch_depth) == (60_416, 3, DISK, 2)
    assert p.activations == "recompute"
    assert p.param_tier in (HOST, DISK)


def test_the_smallest_budget_trains_micro_batches_cut_from_one_batch(gpt, tmp_path):
    """The trainer's micro-batches are views of the step's batch: on a CPU the engine gives each its own storage,
    so a block saving the ids is charged for its micro-batch (as profiled), not the whole batch — at the
    planner's smallest budget the step runs within it."""
    m, prof = gpt
    with pytest.raises(StratumError) as e:
        plan(m, prof, device_budget=10_000, n_micro=4, activations="keep")
    smallest = int(re.search(r"\(([\d,]+) bytes\)", str(e.value)).group(1).replace(",", ""))
    p = plan(m, prof, device_budget=smallest, n_micro=4, activations="keep")
    eng = OffloadEngine(build("gpt", tmp_path), optim=spec(), device=DEV, placement=p)
    data = torch.randint(0, V, (4 * B, T + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    eng.train_step([Batch(x=x[k * B:(k + 1) * B], y=y[k * B:(k + 1) * B]) for k in range(4)], 1e-3)
    assert eng.tiers[DEVICE].peak <= smallest
    eng.close()


def test_an_override_that_fits_nothing_is_named_and_budgets_never_blamed(gpt):
    """Unlimited budgets cannot be what fails: the error names the override, and only the overrides given."""
    m, prof = gpt
    with pytest.raises(StratumError) as e:
        plan(m, prof, resident_chunks=1, activations="recompute")
    msg = str(e.value)
    assert "(with offload.resident_chunks, offload.activations as given)" in msg
    assert "unset the overrides" in msg and "raise both budgets" not in msg
    with pytest.raises(StratumError) as e:
        plan(m, prof, device_budget=10_000)
    assert "as given" not in str(e.value)


def test_the_delayed_update_is_planned_only_where_it_runs(gpt):
    """offload.delayed_update: the planner offers bf16 chunks with masters and AdamW in host RAM alone (without it
    the fastest plan keeps AdamW on the device, which the engine would refuse to run delayed)."""
    m, prof = gpt
    free = plan(m, prof, precision="bf16")
    assert free.optimizer_tier == DEVICE and not free.half_params
    for budget in (None, state_bytes(m) // 3):
        p = plan(m, prof, precision="bf16", delayed_update=True, device_budget=budget)
        assert p.half_params and p.optimizer_tier == HOST and p.param_tier != DISK
    with pytest.raises(StratumError, match="offload.delayed_update keeps the fp32 masters and AdamW in host RAM"):
        plan(m, prof, precision="bf16", delayed_update=True, host_budget=1000)


def test_plan_text_has_per_tier_peaks_traffic_and_time(gpt):
    m, prof = gpt
    text = plan(m, prof, device_budget=state_bytes(m) // 4).describe()
    for word in ("device", "host", "disk", "predicted peak", "traffic per step", "predicted step time"):
        assert word in text


@pytest.mark.parametrize("setting,match", [
    ("offload.device_budget='lots'", "offload.device_budget = 'lots' is not a size"),
    ("offload.host_budget='-3GB'", "offload.host_budget"),
    ("offload.optimizer_tier='gpu'", "offload.optimizer_tier"),
    ("offload.activations='swap'", "offload.activations"),
    ("offload.grad_handoff='bucket'", "offload.grad_handoff = 'bucket' is not one of: auto, chunk, tensor"),
    ("offload.grad_handoff='chunk'", "offload.grad_handoff = 'chunk' hands 16-bit gradients over per chunk; with "
                                     "train.precision = 'fp32'"),
    ("offload.chunk_size='1'", "offload.chunk_size"),
    ("offload.prefetch_depth=-2", "offload.prefetch_depth"),
    ("offload.resident_chunks=-1", "offload.resident_chunks"),
    ("offload.delayed_update=true", "runs with bf16 chunks, not train.precision = 'fp32'"),
    ("offload.delayed_update=true,train.precision='bf16',offload.optimizer_tier='disk'",
     "runs the update in host RAM, not with offload.optimizer_tier = 'disk'"),
])
def test_bad_offload_config_is_one_line_error(make_cfg, setting, match):
    with pytest.raises(StratumError, match=match) as e:
        make_cfg("train.engine='offload'", *setting.split(","))
    assert "\n" not in str(e.value)


def _cli(make_cfg, *sets):
    cfg = make_cfg()
    base = [f"data.corpus={cfg.data.corpus!r}", f"data.cache_dir={cfg.data.cache_dir!r}", "data.seq_len=32",
            "model.preset='tiny'", "train.micro_batch_size=4", "train.engine='offload'"]
    out = []
    for s in base + list(sets):
        out += ["--set", s]
    return out


def test_stratum_plan_prints_the_plan(make_cfg, capsys):
    assert main(["plan", *_cli(make_cfg, "offload.device_budget='2MB'")]) == 0
    out = capsys.readouterr().out
    assert "offload plan:" in out and "predicted step time" in out and "device" in out


def test_stratum_plan_refuses_an_impossible_budget(make_cfg, capsys):
    assert main(["plan", *_cli(make_cfg, "offload.device_budget='20kB'")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "smallest offload.device_budget" in err


def test_stratum_plan_refuses_a_delayed_update_it_could_never_place_with_the_reason(make_cfg, capsys):
    # the plain engine's config, as `stratum plan` is usually given: the memory engine's own checks still apply
    args = _cli(make_cfg, "offload.device_budget='2MB'", "offload.delayed_update=true")
    at = args.index("train.engine='offload'")
    del args[at - 1:at + 1]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stratum: error: offload.delayed_update runs with bf16 chunks, not train.precision = "
                          "'fp32'") and err.count("\n") == 0


def test_stratum_plan_sweep_prints_a_row_per_device_budget(make_cfg, capsys):
    """One profile, one row per budget: a budget too small says so (and what would fit) instead of failing the
    command; more budget never predicts a slower step."""
    assert main(["plan", *_cli(make_cfg), "--sweep", "20kB,50%,100%,1000%"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.strip().startswith("device budget"))
    rows = out[head + 1:]
    assert len(rows) == 4
    assert "does not fit" in rows[0] and "smallest offload.device_budget" in rows[0]
    steps = [float(r.split()[-1]) for r in rows[1:]]
    assert steps == sorted(steps, reverse=True)


def test_near_equal_predictions_are_a_tie_won_by_less_traffic():
    """Within TIE of the fastest prediction, the tie-break key (traffic first) decides; beyond it, speed does;
    near-ties are judged against the fastest, so a chain of them cannot drift to a slow plan."""
    from stratum.offload.planner import TIE, choose
    fast, close, slow = 1.0, 1.0 + TIE / 2, 1.0 + 2 * TIE
    assert choose([(fast, (100,), "disk"), (close, (0,), "device")]) == "device"
    assert choose([(fast, (100,), "disk"), (slow, (0,), "device")]) == "disk"
    chain = [(fast, (3,), "a"), (close, (2,), "b"), (close + TIE / 2 + 1e-9, (1,), "c")]  # c is not within TIE of a
    assert choose(chain) == "b"


def test_ties_are_narrowed_to_the_plans_that_stay_fast_on_a_slower_disk(gpt, monkeypatch):
    """Of tied plans, those also fastest at SLOW_DISK of the probed disk bandwidths stay (then traffic decides);
    a plan outside the tie is not brought back by its slow-disk time (beyond RAM a fast probe tied a plan without
    deferred updates to one with; the first moved less, and on the disk's usual rate its backward was disk-bound)."""

    from stratum.ir.costs import Costs
    from stratum.offload.chunks import pack
    from stratum.offload.planner import SLOW_DISK, TIE, choose
    from stratum.offload.step_model import predict_placement
    from stratum.offload.tiers import Bandwidths
    close = 1.0 + TIE / 2
    on_slow = {"lean": 2.0, "balanced": 1.5, "outside": 1.0}.__getitem__
    fits = [(1.0, (0,), "lean"), (close, (5,), "balanced"), (1.0 + 2 * TIE, (0,), "outside")]
    assert choose(fits) == "lean"
    assert choose(fits, on_slow) == "balanced"
    assert choose(fits[:1], on_slow) == "lean"
    # the planner asks it for each tied plan's step with the disk at SLOW_DISK of the probe (none without a probe)
    import stratum.offload.planner as planner
    m, prof = gpt
    seen = {}

    def spy(fits, slow=None):
        seen["slow"] = slow
        return choose(fits, slow)
    monkeypatch.setattr(planner, "choose", spy)
    plan(m, prof, clip=0.0)
    assert seen["slow"] is None
    bw = Bandwidths(h2d=1e12, d2h=1e12, disk_read=4e8, disk_write=4e8, adam_params_per_s=1e15)
    p = plan(m, prof, clip=0.0, device_budget=state_bytes(m) // 4, optimizer_tier=DISK, bandwidths=bw)
    slow_bw = dataclasses.replace(bw, disk_read=bw.disk_read * SLOW_DISK, disk_write=bw.disk_write * SLOW_DISK)
    kw = dict(costs=Costs.blocks(prof), n_micro=2, deferred=False,
              n_params=sum(x.numel() for x in m.parameters()))
    lay = pack(m, p.chunk_elems)
    assert predict_placement(lay, p, bw=bw, **kw)[2] == pytest.approx(p.predicted_step_s)
    assert seen["slow"](p) == pytest.approx(predict_placement(lay, p, bw=slow_bw, **kw)[2])
    assert seen["slow"](p) > p.predicted_step_s  # its moments are on the (slower) disk


@pytest.mark.parametrize("args, match", [(["--sweep", "abc%"], "not a percentage"),
                                         (["--sweep", "2GBx"], "is not a size"),
                                         (["--sweep", "--json", "p.json"], "--json writes one plan")])
def test_stratum_plan_sweep_refuses_bad_budgets_in_one_line(make_cfg, capsys, args, match):
    assert main(["plan", *_cli(make_cfg), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err


def test_unwritable_disk_dir_is_refused_before_training(make_cfg, tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert main(["plan", *_cli(make_cfg, f"offload.disk_dir={str(f / 'sub')!r}")]) == 2
    assert f"offload.disk_dir {str(f / 'sub')!r}: {f} is a file, not a directory" in capsys.readouterr().err
    assert main(["plan", *_cli(make_cfg, f"offload.disk_dir={str(f)!r}")]) == 2
    assert f"{f} is a file, not a directory" in capsys.readouterr().err


def test_dry_run_prints_the_plan_and_exits_2_where_none_fits(make_cfg, capsys):
    assert main(["train", "--dry-run", *_cli(make_cfg, "offload.device_budget='2MB'")]) == 0
    assert "offload plan:" in capsys.readouterr().out
    assert main(["train", "--dry-run", *_cli(make_cfg, "offload.device_budget='1KB'")]) == 2  # (a script reads it)
    out, err = capsys.readouterr()
    assert "does not fit — " in out and err.startswith("stratum: error: this run would not start: ")
    assert err.count("\n") == 1 and "smallest offload.device_budget" in err


def test_a_plan_larger_than_the_ram_is_refused_before_its_chunks_are_built(make_cfg, tmp_path, capsys,
                                                                            monkeypatch):
    """Unlimited budgets on a CPU put the whole state in RAM: where that is more than the RAM available, the
    run stops in one line (as the plain engine's would), and the dry run says so with exit 2."""
    import stratum.offload.setup as setup
    monkeypatch.setattr(setup, "device_memory_bytes", lambda device: 1_000_000)  # a 1 MB machine
    args = _cli(make_cfg, "offload.device_budget=''", f"train.out_dir={str(tmp_path / 'o')!r}")
    assert main(["train", "--dry-run", *args]) == 2
    assert "note: on a CPU the device and host tiers are both RAM" in capsys.readouterr().out
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stratum: error: the offload plan cannot run here: on a CPU the device and host tiers "
                          "are both RAM: this plan holds ") and err.count("\n") == 1
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_trainer_with_offload_matches_plain_and_resumes_under_plain(make_cfg, tmp_path):
    common = ("train.steps=6", "train.grad_accum=2")
    ref = train(make_cfg(*common, out=tmp_path / "plain"))
    off = make_cfg(*common, "train.engine='offload'", "offload.device_budget='1.5MB'", out=tmp_path / "off")
    train(off, stop_at=3)
    resumed = make_cfg(*common, out=tmp_path / "off")  # the same run continues on the plain engine
    summary = train(resumed)
    a = [r["loss"] for r in read_metrics(tmp_path / "plain")]
    b = [r["loss"] for r in read_metrics(tmp_path / "off")]
    assert a == b
    assert summary["final_loss"] == ref["final_loss"]
    recs = read_metrics(tmp_path / "off")
    assert "offload_device_peak_bytes" in recs[0]
    # the offload steps log what they moved; the plain steps of the resumed run do not
    assert all(r["moved_h2d_bytes"] > 0 and r["wait_s"] >= 0 for r in recs[:3])
    assert recs[1]["moved_h2d_bytes"] == recs[2]["moved_h2d_bytes"]  # the same every step once recorded
    assert not any(k.startswith("moved_") for r in recs[3:] for k in r)


def test_the_summary_reports_data_moved_and_the_predicted_step_time(make_cfg, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="stratum")
    cfg = make_cfg("train.steps=4", "train.engine='offload'", "offload.device_budget='1.5MB'", out=tmp_path / "o")
    summary = train(cfg)
    assert summary["median_moved_h2d_bytes"] > 0 and summary["median_wait_s"] >= 0
    assert summary["predicted_step_s"] > 0 and summary["median_step_s"] > 0
    out = caplog.text
    assert "moved per step (median): host→device" in out and "predicted by the plan" in out
    plain = train(make_cfg("train.steps=2", out=tmp_path / "p"))
    assert "predicted_step_s" not in plain and "median_moved_h2d_bytes" not in plain


def test_step_time_is_modelled_per_window(gpt):
    """With clipping the host/disk update pass runs beside the next forward, so its traffic loads the forward's
    window: forward compute hides under it for free, while a long backward cannot hide it (the aggregate model,
    max(compute, traffic), got both wrong — 21 s predicted against 33 s measured beyond RAM)."""
    from stratum.ir.costs import Costs
    from stratum.offload.chunks import pack
    from stratum.offload.placement import KEEP
    from stratum.offload.step_model import predict
    from stratum.offload.tiers import Bandwidths
    m, _ = gpt
    L, lay = len(m), pack(m, 30_000)
    bw = Bandwidths(h2d=1e12, d2h=1e12, disk_read=1e8, disk_write=1e8, adam_params_per_s=1e15)
    moments_read_s = 8 * sum(c.capacity for c in lay.chunks) / 1e8  # inside the clipped update pass

    def step(fwd: float, bwd: float, clipped: bool) -> float:
        costs = Costs(i=[0.0] * L, w=[0.0] * L, f=[fwd / L] * L, b=[bwd / L] * L, act_bytes=[0] * L, out_bytes=[0] * L,
                      spill_bytes=[0] * L)
        return predict(lay, R=2 * lay.max_chunks_per_block(), opt=DISK, ptier=DISK, k=2, acts=KEEP, costs=costs,
                       bw=bw, n_micro=1, deferred=clipped, n_params=m.num_params())[2]
    quiet = step(1e-3, 1e-3, True)
    assert step(moments_read_s, 1e-3, True) == pytest.approx(quiet)  # hidden under the update pass
    long_bwd = 100 * quiet
    assert step(1e-3, long_bwd, False) == pytest.approx(long_bwd, rel=0.02)  # updates hide in the backward
    assert step(1e-3, long_bwd, True) >= long_bwd + moments_read_s  # the update pass does not


def test_prefetch_overlap_is_limited_by_free_slots(gpt):
    """Only the slots beside the running block's chunks can take the next block's: with one spare slot most of
    a transfer-bound step's traffic is exposed, with enough for a whole block none is."""
    from stratum.ir.costs import Costs
    from stratum.offload.chunks import pack
    from stratum.offload.placement import KEEP
    from stratum.offload.step_model import predict
    from stratum.offload.tiers import Bandwidths
    m, _ = gpt
    L, lay = len(m), pack(m, 30_000)
    need = lay.max_chunks_per_block()
    assert need >= 3
    bw = Bandwidths(h2d=1e12, d2h=1e12, disk_read=1e8, disk_write=1e8, adam_params_per_s=1e15)
    costs = Costs(i=[0.0] * L, w=[0.0] * L, f=[1.0] * L, b=[2.0] * L, act_bytes=[0] * L, out_bytes=[0] * L, spill_bytes=[0] * L)

    def step(R: int) -> float:
        return predict(lay, R=R, opt=DISK, ptier=DISK, k=2, acts=KEEP, costs=costs, bw=bw, n_micro=1,
                       deferred=False, n_params=m.num_params())[2]
    assert step(need + 1) > step(2 * need - 1) == pytest.approx(step(4 * need))


def test_deferred_updates_move_traffic_from_the_backward_to_the_forward(gpt):
    """On a CPU without clipping, deferring the first-completed chunks' updates to beside the next forward moves
    their moment and parameter traffic out of the backward (plus one gradient write and read): the planner picks
    it when the backward is disk-bound and the forward has time to spare, and not when nothing is disk-bound."""
    from stratum.ir.costs import Costs
    from stratum.offload.chunks import pack
    from stratum.offload.placement import KEEP
    from stratum.offload.planner import _deferral_options
    from stratum.offload.step_model import predict
    from stratum.offload.tiers import Bandwidths
    m, _ = gpt
    L, lay = len(m), pack(m, 30_000)
    bw = Bandwidths(h2d=1e12, d2h=1e12, disk_read=1e8, disk_write=1e8, adam_params_per_s=1e15)
    options = _deferral_options(lay, DISK, DISK, False, bw)
    assert options[0] == frozenset() and len(options) > 2
    first = options[1]
    stream = [c.index for c in lay.chunks if not c.pinned]
    # the deferred chunks are the first to complete their gradients: the highest blocks'
    assert min(lay.ready_block[i] for i in first) >= max(lay.ready_block[i] for i in set(stream) - first)
    assert _deferral_options(lay, DISK, DISK, True, bw) == [frozenset()]  # clipping defers every update anyway
    assert _deferral_options(lay, DEVICE, DISK, False, bw) == [frozenset()]

    def run(fwd: float, bwd: float, late: frozenset[int]):
        costs = Costs(i=[0.0] * L, w=[0.0] * L, f=[fwd / L] * L, b=[bwd / L] * L, act_bytes=[0] * L, out_bytes=[0] * L,
                      spill_bytes=[0] * L)
        _, tr, step, _, _ = predict(lay, R=2 * lay.max_chunks_per_block(), opt=DISK, ptier=DISK, k=2, acts=KEEP,
                                    costs=costs, bw=bw, n_micro=1, deferred=False, n_params=m.num_params(),
                                    deferred_chunks=late)
        return tr, step
    C4 = lay.chunk_elems * 4
    tr0, _ = run(1.0, 1.0, frozenset())
    tr1, _ = run(1.0, 1.0, first)
    # each deferred chunk adds a gradient write and the parameter + gradient reads of its later update
    assert tr1["disk_write"] - tr0["disk_write"] == len(first) * C4
    assert tr1["disk_read"] - tr0["disk_read"] == 2 * len(first) * C4
    disk_s = (tr0["disk_read"] + tr0["disk_write"]) / 1e8
    # a backward that the disk bounds, a forward with time to spare: deferring shortens the step
    _, slow = run(disk_s, 1e-3, frozenset())
    _, fast = run(disk_s, 1e-3, first)
    assert fast < slow
    # nothing is disk-bound: deferring only adds traffic, and the planner's tie-break refuses it
    fast = Bandwidths(h2d=1e15, d2h=1e15, disk_read=1e15, disk_write=1e15, adam_params_per_s=1e15)
    _, prof = gpt
    p = plan(m, prof, clip=0.0, device_budget=state_bytes(m) // 4, optimizer_tier=DISK, bandwidths=fast)
    assert p.param_tier != DEVICE and p.deferred_chunks == ()


def test_a_cpu_counts_its_memcpys_as_compute(gpt):
    """On a CPU a host↔device copy is a memcpy on the cores that train (on the training thread itself): the step
    is compute plus every copied byte at the measured rate, prefetched or not, where a GPU's side stream hides
    them. Gradients handed to the host optimizer are not copied at all."""
    from stratum.ir.costs import Costs
    from stratum.offload.chunks import pack
    from stratum.offload.placement import KEEP
    from stratum.offload.step_model import predict
    from stratum.offload.tiers import Bandwidths
    m, _ = gpt
    L, lay = len(m), pack(m, 30_000)
    need = lay.max_chunks_per_block()
    n_stream = len(lay.streamable)
    assert n_stream >= 2 * need  # room for a full prefetch
    costs = Costs(i=[0.0] * L, w=[0.0] * L, f=[1e-3] * L, b=[2e-3] * L, act_bytes=[0] * L, out_bytes=[0] * L, spill_bytes=[0] * L)

    def step(R: int, k: int, async_copies: bool):
        bw = Bandwidths(h2d=1e9, d2h=1e9, disk_read=1e8, disk_write=1e8, adam_params_per_s=1e15,
                        async_copies=async_copies)
        _, tr, s, _, _ = predict(lay, R=R, opt=HOST, ptier=HOST, k=k, acts=KEEP, costs=costs, bw=bw, n_micro=1,
                                 deferred=True, n_params=m.num_params())
        return tr, s
    compute = 3e-3 * L
    tr, cpu = step(2 * need, 4, False)
    assert tr["h2d"] > 0 and tr["d2h"] == 0  # fetched parameters in; gradients handed over, not copied
    assert cpu == pytest.approx(compute + tr["h2d"] / 1e9 + m.num_params() / 1e15)
    _, gpu = step(2 * need, 4, True)
    assert gpu == pytest.approx(compute + m.num_params() / 1e15)
    tr_few, few = step(need, 4, False)  # no slot to prefetch into: the same memcpys, on demand
    assert tr_few["h2d"] > tr["h2d"] and few == pytest.approx(compute + tr_few["h2d"] / 1e9 + m.num_params() / 1e15)


def test_the_last_blocks_can_keep_their_activations_on_the_device(gpt):
    """Spilled activations of the forward's last block would be copied straight back (its backward is next):
    keeping them costs no device bytes and saves their round trip; keeping one more costs its bytes. The planner
    picks the free one on a CPU, where those copies cost compute."""
    from stratum.ir.costs import Costs
    from stratum.offload.chunks import pack
    from stratum.offload.placement import SPILL
    from stratum.offload.planner import _kept_options
    from stratum.offload.step_model import predict
    from stratum.offload.tiers import Bandwidths
    m, prof = gpt
    L, lay = len(m), pack(m, 30_000)
    assert _kept_options(SPILL, L, None, False)[:3] == [frozenset(), frozenset({L - 1}), frozenset({L - 2, L - 1})]
    assert _kept_options("keep", L, None, False) == [frozenset()] == _kept_options(SPILL, L, 0, False)
    assert _kept_options(SPILL, L, None, True) == [frozenset()]  # a pipeline rank keeps no block's
    a = 1 << 20
    costs = Costs(i=[0.0] * L, w=[0.0] * L, f=[1e-3] * L, b=[2e-3] * L, act_bytes=[a] * L, out_bytes=[1000] * L,
                  spill_bytes=[a] * L)
    bw = Bandwidths(h2d=1e9, d2h=1e9, disk_read=1e8, disk_write=1e8, adam_params_per_s=1e15)

    def run(kept):
        return predict(lay, R=4, opt=HOST, ptier=HOST, k=2, acts=SPILL, costs=costs, bw=bw, n_micro=2,
                       deferred=True, n_params=m.num_params(), kept=frozenset(kept))
    peak0, tr0, s0, _, _ = run(())
    peak1, tr1, s1, _, _ = run((L - 1,))
    peak2, tr2, _, _, _ = run((L - 2, L - 1))
    assert peak1[DEVICE] == peak0[DEVICE] and peak2[DEVICE] == peak0[DEVICE] + a
    assert tr0["d2h"] - tr1["d2h"] == tr0["h2d"] - tr1["h2d"] == 2 * a  # two micro-batches' round trips
    assert peak0[HOST] - peak1[HOST] == a and s1 == pytest.approx(s0 - 4 * a / 1e9)
    S = state_bytes(m)
    p = plan(m, prof, device_budget=S // 4, activations=SPILL, bandwidths=bw)
    assert p.kept_blocks and p.kept_blocks[-1] == L - 1 and len(p.kept_blocks) < L
    assert f"kept on the device for the last {len(p.kept_blocks)}" in p.describe()
    # a spill set the host's room chose need not hold the kept blocks: only those spilled and not kept are counted
    some = dataclasses.replace(p, spill_blocks=(0, L - 1), disk_spill_blocks=(), kept_blocks=(L - 2, L - 1),
                               recomputes_some=True)
    assert "offload for 1 blocks, kept on the device for the last 2, recompute for the rest" in some.describe()


def test_a_pipeline_rank_prices_its_in_flight_micro_batches(gpt):
    """Placement.inflight (a pipeline rank's micro-batches in flight per block): keep holds every in-flight
    micro-batch's saved activations; recompute their checkpoints + one block's saved tensors; offload the
    checkpoints not spilled + one micro-batch's fetched back + one block's, the spilled ones on the host and
    moved once each way per micro-batch; both recompute every block."""
    from stratum.ir.costs import Costs
    from stratum.offload.chunks import pack
    from stratum.offload.placement import KEEP, RECOMPUTE, SPILL
    from stratum.offload.step_model import predict
    m, _ = gpt
    L, lay = len(m), pack(m, 30_000)
    a, ckpt, spill, f = 1 << 20, 3000, 2000, 1e-3
    costs = Costs(i=[0.0] * L, w=[0.0] * L, f=[f] * L, b=[2 * f] * L, act_bytes=[a] * L, out_bytes=[ckpt] * L,
                  spill_bytes=[spill] * L)

    def run(acts):
        return predict(lay, R=4, opt=HOST, ptier=HOST, k=2, acts=acts, costs=costs, bw=None, n_micro=4,
                       deferred=True, n_params=m.num_params(), inflight=(3,) * L)
    keep, rec, off = run(KEEP), run(RECOMPUTE), run(SPILL)
    assert keep[4] == 3 * L * a and rec[4] == 3 * L * ckpt + a
    assert off[4] == 3 * L * (ckpt - spill) + L * spill + a
    assert off[0][HOST] - rec[0][HOST] == 3 * L * spill and rec[0][HOST] == keep[0][HOST]
    assert off[1]["d2h"] - rec[1]["d2h"] == off[1]["h2d"] - rec[1]["h2d"] == 4 * L * spill
    assert rec[2] == off[2] == pytest.approx(keep[2] + 4 * L * f)


def test_a_search_cut_by_its_bound_says_so(gpt, monkeypatch):
    """The search is bounded by a count of candidates; a plan found by a search the bound cut short says so."""
    from stratum.offload import planner
    m, prof = gpt
    full = plan(m, prof, device_budget=state_bytes(m) // 4)
    assert not full.search_cut and "stopped" not in full.describe()
    monkeypatch.setattr(planner, "MAX_EVALUATIONS", 50)
    cut = plan(m, prof, device_budget=state_bytes(m) // 4)
    assert cut.search_cut and 50 <= cut.candidates < full.candidates  # the bound counts once a plan fits
    assert "the search stopped at its bound of 50" in cut.describe()


def test_the_plan_does_not_depend_on_the_machine_s_speed(gpt, monkeypatch):
    """A loaded machine runs the search slower; the plan is the same (a clock racing ahead by a minute per
    reading stands for a very busy machine), including one the bound cuts short."""
    import time as time_module

    from stratum.offload import planner
    m, prof = gpt
    budget = state_bytes(m) // 4
    idle = [plan(m, prof, device_budget=budget).to_dict()]
    monkeypatch.setattr(planner, "MAX_EVALUATIONS", 200)
    idle.append(plan(m, prof, device_budget=budget).to_dict())
    clock = iter(range(0, 10**9, 60))
    monkeypatch.setattr(time_module, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(time_module, "monotonic", lambda: float(next(clock)))
    busy = plan(m, prof, device_budget=budget).to_dict()
    monkeypatch.setattr(planner, "MAX_EVALUATIONS", 8_000)
    assert plan(m, prof, device_budget=budget).to_dict() == idle[0] and busy == idle[1]


def test_an_infeasible_budget_is_answered_in_the_units_typed(make_cfg, capsys):
    """"1GB" typed → the smallest budget in GB (rounded up: typed back, it fits); "1MiB" → in MiB."""
    from stratum.units import Size, fmt_at_least, parse_budget
    assert main(["plan", *_cli(make_cfg, "offload.device_budget='20kB'")]) == 2
    err = capsys.readouterr().err
    assert "offload.device_budget = 20kB " in err and "GiB" not in err and "MiB" not in err
    smallest = re.search(r"smallest offload.device_budget that works with this host budget is ([\d.]+ [kMG]B) "
                         r"\(([\d,]+) bytes\)", err)
    assert smallest, err
    typed_back = smallest.group(1).replace(" ", "")
    assert parse_budget(typed_back, "b") >= int(smallest.group(2).replace(",", ""))
    assert main(["plan", *_cli(make_cfg, f"offload.device_budget='{typed_back}'")]) == 0
    assert fmt_at_least(1_549_230_084, Size(10**9, "1GB")) == "1.55 GB"
    assert fmt_at_least(1_549_230_084, Size(2**30, "1GiB")) == "1.45 GiB"
    assert fmt_at_least(999, Size(10**9, "1 GB")) == "999 B"
    assert main(["plan", *_cli(make_cfg, "offload.device_budget='20KiB'")]) == 2
    assert "KiB (" in capsys.readouterr().err


def test_slots_are_counted_at_the_layouts_rounded_chunk_size(gpt):
    """A requested chunk size is rounded up to the layout's alignment; the slots the device budget allows are
    counted at the rounded size, so the plan holds as many slots as fit, not the fewest after a count that
    overshot (the search once sized slots at the requested size and then found that many did not fit)."""
    from stratum.offload.chunks import ALIGN_ELEMS, pack
    from stratum.offload.step_model import slot_bytes
    m, prof = gpt
    biggest = max(p.numel() for p in m.parameters())
    for chunk in (biggest + 1, 2 * biggest + ALIGN_ELEMS // 2 + 1):
        layout = pack(m, chunk)
        assert layout.chunk_elems > chunk  # the case at hand: rounded up
        budget = state_bytes(m) // 3
        p = plan(m, prof, device_budget=budget, chunk_elems=chunk, optimizer_tier=HOST, activations="keep",
                 n_micro=1, clip=0.0)
        assert p.param_tier != DEVICE
        one_more = slot_bytes(layout.chunk_elems, p.optimizer_tier, p.param_tier, None)
        assert p.predicted_peak[DEVICE] + one_more > budget or p.resident_chunks == len(layout.streamable)


def test_the_host_probes_are_sized_to_the_model(make_cfg, monkeypatch):
    """The copy and AdamW probes that price a plan move the model's fp32 weights (1 MiB to 32 MiB): the tiny GPT's
    plan is priced from a 1 MiB copy and AdamW over 2^17 parameters; a machine probe (no model) keeps 32 MiB."""
    import torch

    from stratum.model.gpt import build_gpt
    from stratum.offload import tiers
    from stratum.offload.setup import placement_inputs

    assert tiers.host_probe_bytes(1000) == tiers.MIN_HOST_PROBE == 1 << 20
    assert tiers.host_probe_bytes(10**9) == tiers.PROBE_BYTES == 32 << 20
    assert tiers.host_probe_bytes(1_000_000) == 4_001_792  # 4 MB of weights, rounded up to whole 4 KiB pages
    probes: list[tuple[str, int]] = []
    monkeypatch.setattr(tiers, "_measure_copy", lambda device, n: probes.append(("copy", n)) or (2e9, 1e9))
    monkeypatch.setattr(tiers, "_measure_adam", lambda n: probes.append(("adam", n)) or 3e8)
    cached = (tiers._measure_adam_here, tiers._measure_adam_beside)
    try:
        for f in cached:  # the real rates are cached per process: the fakes must neither see them nor stay
            f.cache_clear()
        model = build_gpt("tiny", vocab_size=256, seed=0)
        assert sum(p.numel() for p in model.parameters()) * 4 < 1 << 20
        bw = placement_inputs(make_cfg(), model, torch.device("cpu"))["bandwidths"]
        assert sorted(probes) == [("adam", 1 << 17), ("adam", 1 << 17), ("copy", 1 << 20)]
        assert (bw.h2d, bw.d2h, bw.adam_params_per_s, bw.adam_inline_params_per_s) == (2e9, 1e9, 3e8, 3e8)
        probes.clear()
        tiers.measure_bandwidths(torch.device("cpu"), None)
        assert sorted(probes) == [("adam", 1 << 22), ("adam", 1 << 22), ("copy", 32 << 20)]
    finally:
        for f in cached:
            f.cache_clear()


def test_a_cpu_plan_over_the_ram_available_says_so(monkeypatch):
    from stratum.offload import setup
    from stratum.offload.placement import Placement
    plan = Placement(chunk_elems=1024, resident_chunks=1, optimizer_tier="host", param_tier="host", prefetch_depth=1,
                     predicted_peak={"device": 600, "host": 500, "disk": 10**9})
    monkeypatch.setattr(setup, "device_memory_bytes", lambda device: 1000)
    note = setup.ram_note(plan, torch.device("cpu"))
    assert note.startswith("\n  note: on a CPU the device and host tiers are both RAM: this plan holds 1.07 KiB")
    monkeypatch.setattr(setup, "device_memory_bytes", lambda device: 1100)  # (the disk tier is not RAM)
    assert setup.ram_note(plan, torch.device("cpu")) == ""
