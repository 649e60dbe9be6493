"""SIMULATED pipeline schedule table (issue 4): bubble ratio, makespan and peak activation per rank.

Run:  python benchmarks/schedules_sim.py     (writes benchmarks/results/schedules_sim.json, prints the table; ~2 s)

Nothing here runs a model: every number comes from ``stratum.sim.pipeline.simulate`` (event simulation).
Cost model, per rank and micro-batch (split evenly over the rank's stages, so every schedule does the same work):
forward 10 ms, backward 20 ms (input-grad 10 ms + weight-grad 10 ms); activation memory 1 unit = what one
micro-batch keeps alive for all of one rank's layers. Communication:
- ``zero``: messages are free;
- ``realistic``: each cross-rank message carries 16 MiB (micro-batch 4 x 1024 tokens x 2048 hidden x bf16) over a
  10 GB/s link with 20 us latency, i.e. ~1.7 ms, 17% of a rank's forward; hand-offs on one rank are free.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from stratum.atomic import atomic_write_json
from stratum.schedule.generators import generate
from stratum.schedule.validate import validate
from stratum.sim.pipeline import Costs, simulate

F_S, B_S, I_S, W_S = 0.010, 0.020, 0.010, 0.010
MSG_BYTES = 4 * 1024 * 2048 * 2
COMM = {"zero": dict(latency=0.0, bandwidth=math.inf),
        "realistic": dict(latency=20e-6, bandwidth=10e9)}
SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"virtual": 2}), ("interleaved", {"virtual": 4}),
             ("wave", {"waves": 1}), ("wave", {"waves": 2}), ("zb-1f1b", {}), ("zb-wave", {"waves": 1}),
             ("zb-wave", {"waves": 2})]
OUT = Path(__file__).resolve().parent / "results" / "schedules_sim.json"


def main() -> int:
    rows = []
    t0 = time.perf_counter()
    for P in (2, 4, 8):
        for m in (P, 2 * P, 4 * P):
            for kind, extra in SCHEDULES:
                s = generate(kind, ranks=P, microbatches=m, **extra)
                validate(s)
                v = s.num_stages // P
                for comm, link in COMM.items():
                    costs = Costs.unit(s.num_stages, stages_per_rank=v, f=F_S, b=B_S, i=I_S, w=W_S, act_bytes=1.0,
                                       out_bytes=MSG_BYTES, **link)
                    r = simulate(s, costs)
                    rows.append({"P": P, "m": m, "comm": comm, "schedule": s.name, "stages": s.num_stages,
                                 "bubble": round(r.bubble, 4), "makespan_s": round(r.makespan, 6),
                                 "peak_act_per_rank": [round(x, 3) for x in r.peak_act],
                                 "max_peak_act": round(max(r.peak_act), 3)})
    claims = _claims(rows)
    atomic_write_json(OUT, {
        "SIMULATED": True,
        "note": "event simulation, not a measurement; see the module docstring for the cost model",
        "command": "python benchmarks/schedules_sim.py",
        "cost_model": {"fwd_s_per_rank_mb": F_S, "bwd_s_per_rank_mb": B_S, "bwd_input_s": I_S, "bwd_weight_s": W_S,
                       "message_bytes": MSG_BYTES, "comm": {k: {"latency_s": v["latency"],
                                                               "bandwidth_Bps": str(v["bandwidth"])}
                                                           for k, v in COMM.items()},
                       "activation_unit": "one micro-batch's saved activations for one rank's share of the layers"},
        "rows": rows, "claims": claims,
    })
    _print(rows, claims)
    print(f"\nwrote {OUT} in {time.perf_counter() - t0:.1f} s (SIMULATED)")
    return 0


def _get(rows, P, m, comm, name):
    return next(r for r in rows if (r["P"], r["m"], r["comm"], r["schedule"]) == (P, m, comm, name))


def _claims(rows) -> list[dict]:
    """Hanayo's claims per (P, m): wave-W vs interleaved v=2W, and zb-wave vs zb-1f1b."""
    out = []
    for P in (2, 4, 8):
        for m in (P, 2 * P, 4 * P):
            for W in (1, 2):
                wz, iz = _get(rows, P, m, "zero", f"wave-w{W}"), _get(rows, P, m, "zero", f"interleaved-v{2 * W}")
                wr, ir = (_get(rows, P, m, "realistic", f"wave-w{W}"),
                          _get(rows, P, m, "realistic", f"interleaved-v{2 * W}"))
                out.append({"P": P, "m": m, "claim": f"wave-w{W} vs interleaved-v{2 * W}",
                            "bubble_zero": [wz["bubble"], iz["bubble"]],
                            "bubble_lower_bound": round((P - 1) / (2 * W * m + P - 1), 4),
                            "bubble_le": wz["bubble"] <= iz["bubble"] + 1e-9,
                            "max_peak_act": [wz["max_peak_act"], iz["max_peak_act"]],
                            "memory_le": wz["max_peak_act"] <= iz["max_peak_act"] + 1e-9,
                            "makespan_realistic_s": [wr["makespan_s"], ir["makespan_s"]],
                            "makespan_lt": wr["makespan_s"] < ir["makespan_s"]})
            for comm, W in ((c, w) for w in (1, 2) for c in COMM):
                zw, z1 = _get(rows, P, m, comm, f"zb-wave-w{W}"), _get(rows, P, m, comm, "zb-1f1b")
                out.append({"P": P, "m": m, "claim": f"zb-wave-w{W} vs zb-1f1b ({comm})",
                            "makespan_s": [zw["makespan_s"], z1["makespan_s"]],
                            "bubble": [zw["bubble"], z1["bubble"]],
                            "max_peak_act": [zw["max_peak_act"], z1["max_peak_act"]],
                            "makespan_lt": zw["makespan_s"] < z1["makespan_s"]})
    return out


def _print(rows, claims) -> None:
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    for comm in COMM:
        print(f"\nSIMULATED, {comm} communication: bubble / makespan ms / max peak activation (micro-batch units)")
        print(f"{'P':>2} {'m':>3} " + " ".join(f"{n:>19}" for n in names))
        for P in (2, 4, 8):
            for m in (P, 2 * P, 4 * P):
                cells = []
                for n in names:
                    r = _get(rows, P, m, comm, n)
                    cells.append(f"{r['bubble']:.3f}/{r['makespan_s'] * 1e3:6.1f}/{r['max_peak_act']:4.2f}")
                print(f"{P:>2} {m:>3} " + " ".join(f"{c:>19}" for c in cells))
    print("\nHanayo claims (bubble <= and memory <= at zero comm; makespan < with realistic comm):")
    for c in claims:
        if "bubble_le" in c:
            print(f"P={c['P']} m={c['m']:>2} {c['claim']}: bubble {c['bubble_zero']} {'OK' if c['bubble_le'] else 'FAIL'}"
                  f" (bound {c['bubble_lower_bound']})"
                  f", peak {c['max_peak_act']} {'OK' if c['memory_le'] else 'FAIL'}, realistic makespan "
                  f"{c['makespan_realistic_s']} {'OK' if c['makespan_lt'] else 'FAIL'}")
        else:
            print(f"P={c['P']} m={c['m']:>2} {c['claim']}: makespan {c['makespan_s']} "
                  f"{'OK' if c['makespan_lt'] else 'FAIL'}, peak {c['max_peak_act']}")


if __name__ == "__main__":
    sys.exit(main())
