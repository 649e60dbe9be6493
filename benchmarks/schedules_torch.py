"""SIMULATED side by side: Stratum's pipeline schedules against torch.distributed.pipelining's (issue 21).

Run:  python benchmarks/schedules_torch.py [--profile PROFILE.json] [--message-s SECONDS]
      (writes benchmarks/results/schedules_torch.json and the profile it used, schedules_torch_profile.json,
      and prints the tables; ~1 min on 2 cores)

Nothing here runs a pipeline: every makespan is ``stratum.sim.pipeline.simulate`` of a schedule's action lists, torch's
imported through their public ``pipeline_order`` (kinds ``torch:NAME``, :mod:`stratum.schedule.torch_import`).
Costs come from a real model's profile: GPT ``small`` (6 layers, d = 384, byte vocabulary as in pipeline_real.py),
micro-batch 4 x 128 tokens, fp32, one
thread on this machine's CPU (``stratum.profile``, taken here unless ``--profile`` names a saved one). Its per
micro-batch forward, backward, input-grad and weight-grad seconds and saved activations are spread evenly over
each schedule's stages, so every schedule does the same work per rank; a message is one transformer block's
output (the profile's ``out_bytes``). Communication:

- ``zero``: messages are free;
- ``measured``: each cross-rank message costs the one-way time of a message of that size between two gloo
  processes on this machine (half the median round trip), the link Stratum's pipeline engine uses here.

A third cost model, ``unit``, is issue 21's: F = 1, B = 2, I = W = 1 per rank and micro-batch, free messages
(times in units, not seconds); the generators order their schedules for it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stratum.atomic import atomic_write_json
from stratum.dist.launch import free_port
from stratum.errors import StratumError
from stratum.model.gpt import build_gpt
from stratum.profile.profile import Profile
from stratum.profile.profiler import profile_blockseq
from stratum.schedule.generators import generate
from stratum.sim.pipeline import Costs, simulate

OUT = Path(__file__).resolve().parent / "results" / "schedules_torch.json"
GRID = [(P, m) for P in (2, 4, 8) for m in (P, 2 * P, 4 * P)]
# (label, kind, options): grouped by stages per rank v, Stratum's kinds first
KINDS = {
    1: [("gpipe", "gpipe", {}), ("1f1b", "1f1b", {}), ("zb-1f1b", "zb-1f1b", {}),
        ("torch:GPipe", "torch:GPipe", {}), ("torch:1F1B", "torch:1F1B", {})],
    2: [("interleaved-v2", "interleaved", {"virtual": 2}), ("wave-w1", "wave", {"waves": 1}),
        ("zb-wave-w1", "zb-wave", {"waves": 1}), ("torch:Interleaved1F1B-v2", "torch:Interleaved1F1B", {}),
        ("torch:LoopedBFS-v2", "torch:LoopedBFS", {}), ("torch:InterleavedZeroBubble-v2",
                                                         "torch:InterleavedZeroBubble", {}),
        ("torch:ZBVZeroBubble", "torch:ZBVZeroBubble", {}), ("torch:DualPipeV", "torch:DualPipeV", {})],
    4: [("interleaved-v4", "interleaved", {"virtual": 4}), ("wave-w2", "wave", {"waves": 2}),
        ("zb-wave-w2", "zb-wave", {"waves": 2}), ("torch:Interleaved1F1B-v4", "torch:Interleaved1F1B",
                                                  {"virtual": 4}),
        ("torch:LoopedBFS-v4", "torch:LoopedBFS", {"virtual": 4}),
        ("torch:InterleavedZeroBubble-v4", "torch:InterleavedZeroBubble", {"virtual": 4})],
}


# ---- the real model's costs ---------------------------------------------------------------------------------
def take_profile(path: str | None) -> Profile:
    """The saved profile at ``path``, or GPT ``small`` profiled here (micro-batch 4 x 128, fp32, 1 thread)."""
    if path:
        return Profile.load(path)
    torch.set_num_threads(1)
    model = build_gpt("small", vocab_size=256, seed=0, device="meta")
    return profile_blockseq(model, micro_batch=4, seq_len=128, device=torch.device("cpu"), runs=3)


def model_totals(prof: Profile) -> dict:
    """Per micro-batch: seconds of F, B, I, W and saved bytes over the whole model; one block boundary's bytes."""
    blocks = prof.blocks
    inner = blocks[1:-1] or blocks
    return {"f_s": sum(b.fwd_s for b in blocks), "b_s": sum(b.bwd_s for b in blocks),
            "i_s": sum(b.bwd_input_s for b in blocks), "w_s": sum(b.bwd_weight_s for b in blocks),
            "act_bytes": float(sum(b.act_saved_bytes for b in blocks)),
            "message_bytes": float(statistics.median(b.out_bytes for b in inner))}


def stage_costs(tot: dict, stages: int, message_s: float) -> Costs:
    """Every stage 1/S of the model's work and activations; a cross-rank message takes ``message_s``."""
    k = 1.0 / stages
    return Costs(f=[tot["f_s"] * k] * stages, b=[tot["b_s"] * k] * stages, i=[tot["i_s"] * k] * stages,
                 w=[tot["w_s"] * k] * stages, act_bytes=[tot["act_bytes"] * k] * stages,
                 out_bytes=[tot["message_bytes"]] * stages, latency=message_s)


# ---- the measured link ----------------------------------------------------------------------------------------
def _round_trip(x: torch.Tensor, rank: int) -> None:
    """Rank 0 sends ``x`` to rank 1 and waits for it back; rank 1 echoes it."""
    ops = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
    for op in ops:
        op(x, 1 - rank)


def _ping_pong(rank: int, port: int, nbytes: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.zeros(max(1, nbytes // 4))
    _round_trip(x, rank)   # the first message also sets the connection up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        _round_trip(x, rank)
        times.append((time.perf_counter() - t0) / 2)
    if rank == 0:
        Path(out).write_text(str(statistics.median(times)))
    dist.destroy_process_group()


def measure_message_s(nbytes: float, rounds: int = 50) -> float:
    """One-way seconds of an ``nbytes`` message between two gloo processes on this machine."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "message_s")
        mp.spawn(_ping_pong, args=(free_port(), int(nbytes), rounds, out), nprocs=2)
        return float(Path(out).read_text())


# ---- the table ------------------------------------------------------------------------------------------------
def costs_for(model: str, tot: dict, P: int, S: int, links: dict) -> tuple[Costs, float]:
    """Costs of cost model ``model`` for S stages on P ranks, and the activation of one rank's share of a
    micro-batch in their memory unit (peaks are reported in those shares)."""
    if links[model] is None:
        return Costs.unit(S, stages_per_rank=S // P), 1.0
    return stage_costs(tot, S, links[model]), tot["act_bytes"] / P


def one_row(label: str, kind: str, opts: dict, P: int, m: int, tot: dict, links: dict) -> list[dict]:
    """The rows of one schedule at (P, m), one per cost model; a refused schedule's rows carry the reason."""
    base = {"P": P, "m": m, "schedule": label, "source": "torch" if kind.startswith("torch:") else "stratum"}
    try:
        s = generate(kind, ranks=P, microbatches=m, **opts)
    except StratumError as e:
        return [dict(base, comm=c, refused=str(e)) for c in links]
    rows = []
    for comm in links:
        costs, share = costs_for(comm, tot, P, s.num_stages, links)
        r = simulate(s, costs)
        rows.append(dict(base, comm=comm, v=s.num_stages // P, makespan=round(r.makespan, 6),
                         time_unit=r.time_unit, bubble=round(r.bubble, 4),
                         peak_act=round(max(r.peak_act) / share, 3)))
    return rows


def all_rows(tot: dict, links: dict) -> list[dict]:
    return [row for P, m in GRID for v, specs in KINDS.items() for label, kind, opts in specs
            for row in one_row(label, kind, opts, P, m, tot, links)]


def _get(rows: list[dict], P: int, m: int, comm: str, label: str) -> dict:
    return next(r for r in rows if (r["P"], r["m"], r["comm"], r["schedule"]) == (P, m, comm, label))


def _versus(rows: list[dict], P: int, m: int, comm: str, mine: str, theirs: str) -> dict:
    a, b = _get(rows, P, m, comm, mine), _get(rows, P, m, comm, theirs)
    if "refused" in a or "refused" in b:
        return {"P": P, "m": m, "comm": comm, "claim": f"{mine} vs {theirs}", "refused": True}
    return {"P": P, "m": m, "comm": comm, "claim": f"{mine} vs {theirs}",
            "makespan": [a["makespan"], b["makespan"]], "ratio": round(a["makespan"] / b["makespan"], 4),
            "bubble": [a["bubble"], b["bubble"]], "peak_act": [a["peak_act"], b["peak_act"]],
            "makespan_le": a["makespan"] <= b["makespan"] * (1 + 1e-9),
            "makespan_lt": a["makespan"] < b["makespan"] * (1 - 1e-9),
            "peak_le": a["peak_act"] <= b["peak_act"] + 1e-9}


def claims(rows: list[dict], links: dict) -> list[dict]:
    """zb-wave W=1 against ZBV (every cost model); the wave claim against torch's interleaved (measured link);
    the classic schedules against torch's own version of them (profiled costs, zero communication)."""
    out = []
    for P, m in GRID:
        out += [_versus(rows, P, m, c, "zb-wave-w1", "torch:ZBVZeroBubble") for c in links]
        out += [_versus(rows, P, m, "measured", f"wave-w{W}", f"torch:Interleaved1F1B-v{2 * W}") for W in (1, 2)]
        out += [_versus(rows, P, m, "zero", a, b) for a, b in (
            ("gpipe", "torch:GPipe"), ("interleaved-v2", "torch:Interleaved1F1B-v2"),
            ("interleaved-v4", "torch:Interleaved1F1B-v4"), ("zb-wave-w2", "torch:InterleavedZeroBubble-v4"))]
    return out


def _print(rows: list[dict], cl: list[dict], links: dict) -> None:
    for comm in links:
        print(f"\nSIMULATED, {comm} cost model: makespan / bubble / peak activation (micro-batch units)")
        for P, m in GRID:
            for v, specs in KINDS.items():
                cells = []
                for label, _, _ in specs:
                    r = _get(rows, P, m, comm, label)
                    cells.append(f"{label} refused" if "refused" in r else
                                 f"{label} {r['makespan']:.4f}/{r['bubble']:.3f}/{r['peak_act']:.2f}")
                print(f"P={P} m={m:>2} v={v}: " + "; ".join(cells))
    print("\nclaims (ratio = Stratum / torch makespan):")
    for c in cl:
        if c.get("refused"):
            print(f"P={c['P']} m={c['m']:>2} {c['comm']:>8} {c['claim']}: torch refuses this (P, m)")
            continue
        verdict = "<" if c["makespan_lt"] else ("=" if c["makespan_le"] else ">")
        print(f"P={c['P']} m={c['m']:>2} {c['comm']:>8} {c['claim']}: {c['makespan']} ratio {c['ratio']} "
              f"({verdict}), bubble {c['bubble']}, peak {c['peak_act']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="a saved Profile JSON (stratum profile) instead of GPT small")
    ap.add_argument("--message-s", type=float, default=None, help="one-way message seconds of the 'measured' "
                    "link instead of measuring it (e.g. the message_s of an earlier result)")
    ap.add_argument("--out", default=str(OUT), help=f"result JSON (default {OUT})")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    prof = take_profile(a.profile)
    prof.save(str(Path(a.out).with_name(Path(a.out).stem + "_profile.json")))
    tot = model_totals(prof)
    message_s = measure_message_s(tot["message_bytes"]) if a.message_s is None else a.message_s
    links = {"unit": None, "zero": 0.0, "measured": message_s}
    rows = all_rows(tot, links)
    cl = claims(rows, links)
    atomic_write_json(Path(a.out), {
        "SIMULATED": True, "note": "event simulation of action lists, not a pipeline run; costs from a profile",
        "command": " ".join(["python benchmarks/schedules_torch.py"] + (argv if argv is not None else sys.argv[1:])),
        "torch": torch.__version__, "profile": {"model": prof.model, "device": prof.device,
                                                 "micro_batch": prof.micro_batch, "seq_len": prof.seq_len},
        "per_microbatch": tot, "message_s": {k: v for k, v in links.items()},
        "message_share_of_stage_forward_at_v1_P4": round(links["measured"] / (tot["f_s"] / 4), 4),
        "rows": rows, "claims": cl})
    _print(rows, cl, links)
    print(f"\nper micro-batch F {tot['f_s'] * 1e3:.1f} ms, B {tot['b_s'] * 1e3:.1f} ms, message "
          f"{tot['message_bytes'] / 2**20:.2f} MiB in {message_s * 1e3:.3f} ms (gloo)")
    print(f"wrote {a.out} in {time.perf_counter() - t0:.0f} s (SIMULATED)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
