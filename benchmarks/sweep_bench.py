"""Benchmark: one sweep of 8 jobs on 2 local slots under each scheduler (fifo, lrtf with slices ending in a
checkpoint or a paused worker, sharded-lrtf at sweep.device_budget = SHARDED_BUDGET, planned), measured, beside
the simulator's prediction of the same schedule.

The jobs: model.preset ∈ {mini, small} × optim.lr ∈ {1e-3, 3e-3} × data.seq_len ∈ {32, 64}, in that grid
order (the four long `small` jobs last, as a grid written smallest-first gives them); or (``--grid 3``) three
equal `small` jobs. Each scheduler runs the same sweep file in its own directory, one after another, in this
process (one worker server for all). ``--grad-accum 2`` splits each step's 4 sequences into 2 micro-batches, so
planned may run a job as replicate(2) or pipeline(2) over both slots (planned-1slot: the same with every job on
one slot).

Before the sweeps it takes (or reads from its cache) the calibration of fifo, lrtf and planned
(stratum.sweep.plain_calibrate: the sweep's own 4 job shapes, a few steps each, alone and 2 at once through the
sweep's worker path) and, with sharded-lrtf, sharded-lrtf's own (stratum.sweep.shard_calibrate: the same shapes
as offload jobs at the budget, in one shard worker on 2 slots; cached beside the plain one). Each sweep reads the file its scheduler uses through
``sweep.calibration``, so its own ordering (lrtf, planned, sharded-lrtf's remaining times) is the prediction's.
Per scheduler it reports the measured makespan (the scheduling loop's wall time: first job start to last job end)
and three SIMULATED predictions of it: the sweep's own (``makespan.json``, made before its first job from each
job's calibrated time: the prediction the 15 % goal is about — its shape's measured seconds with both slots busy;
sharded-lrtf: on a slot, with the give-backs its device memory forces), from the profiled forward+backward
times alone (one set of profiles, taken up front with the calibration, for every scheduler's prediction), and
from each job's measured median step time (which separates the cost model's error from the scheduling model's;
sharded-lrtf: each job's seconds holding a slot over its steps, from the grants, as a step's wall time there
includes its waits for a slot).

Runbook::

    python benchmarks/sweep_bench.py                       # a few minutes on 2 cores
    python benchmarks/sweep_bench.py --steps 10 --out /tmp/sweep.json
    python benchmarks/sweep_bench.py --only fifo sharded-lrtf planned
    python benchmarks/sweep_bench.py --calibration /tmp/cal.json   # a fresh calibration (default: cached in ~/.cache)
    python benchmarks/sweep_bench.py --only fifo planned-1slot planned --grad-accum 2 --grid 3 \
        --out benchmarks/results/sweep_planned_3jobs.json                 # strategies over both slots

Writes ``benchmarks/results/sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sysconfig
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.profile.profile import Profile
from stratum.sweep.calibrate import with_items
from stratum.sweep.gang_plan import Option
from stratum.sweep.job_strategy import pinned
from stratum.sweep.plain_calibrate import plain_calibration
from stratum.sweep.predict import job_profiles, job_seconds, predicted_seconds
from stratum.sweep.predicted_makespan import plan_sim
from stratum.sweep.runner import open_sweep, run_sweep
from stratum.sweep.shape_cost import ShapeCalibration
from stratum.sweep.shard_calibrate import shard_cache_path, shard_calibration
from stratum.sweep.shard_lrtf import tasks_per_step
from stratum.sweep.shard_size import AUTO, job_shard_blocks
from stratum.sweep.simulate import SimResult, simulate, simulate_sharded
from stratum.sweep.slot_scheduler import DeviceMemory, task_seconds
from stratum.sweep.strategies import scaled
from stratum.train.metrics import median
from stratum.train.trainer import read_metrics
from stratum.units import parse_bytes

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "sweep.json"
VARIANTS = {"fifo": ("fifo", "checkpoint"), "lrtf": ("lrtf", "checkpoint"), "lrtf-pause": ("lrtf", "pause"),
            "sharded-lrtf": ("sharded-lrtf", "checkpoint"), "planned": ("planned", "checkpoint"),
            "planned-1slot": ("planned", "checkpoint")}
"""Name → (sweep.scheduler, sweep.slice_by): lrtf's slices end with a checkpoint, or by pausing the worker;
planned-1slot is planned with sweep.plans = ["local"] (every job on one slot), planned may also run a job as
replicate(2) or pipeline(2) over both slots."""
GRIDS = {"8": '"model.preset" = ["mini", "small"]\n"optim.lr" = [1e-3, 3e-3]\n"data.seq_len" = [32, 64]',
         "3": '"model.preset" = ["small"]\n"optim.lr" = [1e-3, 2e-3, 3e-3]\n"data.seq_len" = [64]'}
"""--grid: the 8 jobs of the runbook, or 3 equal `small` jobs (an odd count on 2 slots: one runs alone at the end
unless a job spans both slots)."""
GLOBAL_BATCH = 4
"""Sequences per optimizer step of every job (micro_batch_size × grad_accum)."""
SHARDED_BUDGET = "32MB"
"""sharded-lrtf: sweep.device_budget (every job runs under the offload engine at this budget)."""
DEFAULT_CACHE = Path("~/.cache/stratum/sweep_calibration.json").expanduser()
"""--calibration's default: the plain calibration's cache (sharded-lrtf's beside it)."""


def base_text(*, steps: int, corpus: str, cache: str, grad_accum: int = 1) -> str:
    """The jobs' base config (the [data] and [train] tables of the sweep file): 4 sequences per step, in
    ``grad_accum`` micro-batches."""
    return f"""[data]
corpus = "{corpus}"
cache_dir = "{cache}"
[train]
steps = {steps}
micro_batch_size = {GLOBAL_BATCH // grad_accum}
grad_accum = {grad_accum}
eval_interval = 0
eval_batches = 2
ckpt_minutes = 0.0
"""


def sweep_text(out_dir: Path, scheduler: str, slice_by: str, *, steps: int, segment_steps: int, corpus: str,
               cache: str, grad_accum: int = 1, name: str = "", grid: str = "8", calibration: str = "off",
               shard_blocks: int = AUTO, device_memory: str = "") -> str:
    return f"""[sweep]
out_dir = "{out_dir}"
slots = 2
scheduler = "{scheduler}"
calibration = "{calibration}"
slice_by = "{slice_by}"
{'plans = ["local"]' if name == "planned-1slot" else ""}
segment_steps = {segment_steps if scheduler == "lrtf" else 0}
{f'device_budget = "{SHARDED_BUDGET}"' if scheduler == "sharded-lrtf" else ""}
shard_blocks = {shard_blocks}
device_memory = "{device_memory}"
[sweep.grid]
{GRIDS[grid]}
""" + base_text(steps=steps, corpus=corpus, cache=cache, grad_accum=grad_accum)


def cal_file(cache: Path, scheduler: str) -> str:
    """The calibration file the sweep reads (sweep.calibration): what its own ordering (fifo: none) and its own
    predicted makespan go through."""
    return str(shard_cache_path(cache) if scheduler == "sharded-lrtf" else cache)


def planned_sim(candidates: dict[str, dict[str, Option]], local_s: dict[str, float],
                launch_s: dict[int, float]) -> SimResult:
    """SIMULATED: the planned scheduler's plan (MILP over each job's strategies, two slots) for jobs whose local
    run takes ``local_s`` — the strategies' times those ratios of it plus a multi-process run's start-up, as the
    runner predicts them."""
    options = {j: {n: replace(o, seconds=o.seconds + launch_s.get(o.devices, 0.0))
                   for n, o in scaled(candidates[j], local_s[j]).items()}
               for j in local_s}
    return plan_sim(options, 2, 10.0)


def one(name: str, root: Path, args: argparse.Namespace, corpus: str,
        cals: dict[str, ShapeCalibration],
        profiles: dict[str, Profile]) -> dict:
    scheduler, slice_by = VARIANTS[name]
    path = root / f"{name}.toml"
    path.write_text(sweep_text(root / name, scheduler, slice_by, steps=args.steps, segment_steps=args.segment_steps,
                               corpus=corpus, cache=str(root / "cache"), grad_accum=args.grad_accum, name=name,
                               grid=args.grid, calibration=cal_file(args.calibration, scheduler),
                               shard_blocks=args.shard_blocks, device_memory=args.device_memory))
    sweep = run_sweep(path, say=lambda line: None)
    rows = sweep.state.jobs()
    assert all(r.status == "done" for r in rows), [(r.id, r.status, r.reason) for r in rows]
    steps = {r.id: r.steps for r in rows}
    prof_step_s = {j: predicted_seconds(profiles[j], sweep.configs[j], 1) for j in steps}
    # the calibrated job time, spread over the job's steps (the simulators take step times); sharded-lrtf: its
    # shape's seconds on a slot from its own calibration (the job's config carries the budget)
    cal = cals["sharded-lrtf" if scheduler == "sharded-lrtf" else "plain"]
    cal_step_s = {j: job_seconds(profiles[j], sweep.configs[j], steps[j], cal) / steps[j] for j in steps}
    # the sweep's own prediction, made before its first job from the same calibration file
    predicted = json.loads((root / name / "makespan.json").read_text())
    meas_step_s = {j: median(read_metrics(root / name / "jobs" / j), "step_s") for j in steps}
    seg = args.segment_steps if scheduler == "lrtf" else 0
    if scheduler == "sharded-lrtf":
        tasks = {j: tasks_per_step(len(profiles[j].blocks), job_shard_blocks(profiles[j], c, args.shard_blocks),
                                   c.micro_batches_per_step) for j, c in sweep.configs.items()}
        # a job's step time in its metrics includes its waits for a slot: its busy time comes from the grants
        meas_step_s = {j: sum(ts) / steps[j] for j, ts in task_seconds(root / name / "shard_tasks.jsonl").items()}
        sim_prof = simulate_sharded(steps, prof_step_s, tasks, slots=2)
        sim_meas = simulate_sharded(steps, meas_step_s, tasks, slots=2)
    elif scheduler == "planned":  # the plan over each job's strategies (local, replicate(2), pipeline(2))
        ran = {j: pinned(sweep.state, j) or "local" for j in steps}
        sim_prof = planned_sim(sweep.candidates, {j: prof_step_s[j] * steps[j] for j in steps}, sweep.launch_s)
        # each job as it ran: its strategy, its measured step time
        sim_meas = planned_sim({j: {ran[j]: replace(sweep.candidates[j][ran[j]], seconds=1.0)} for j in steps},
                               {j: meas_step_s[j] * steps[j] for j in steps}, sweep.launch_s)
    else:
        sim_prof = simulate(scheduler, steps, prof_step_s, slots=2, segment_steps=seg)
        sim_meas = simulate(scheduler, steps, meas_step_s, slots=2, segment_steps=seg)
    held = device_holding(root / name / "shard_tasks.jsonl") if scheduler == "sharded-lrtf" else None
    return {"measured_makespan_s": sweep.makespan_s, "launch_s": sweep.launch_s, "measured_busy_s": sum(r.run_s for r in rows),
            "device_holding": held,
            "simulated_makespan_s_calibrated": predicted["predicted_s"],
            "simulated_makespan_s_profile": sim_prof.makespan,
            "simulated_makespan_s_measured_steps": sim_meas.makespan,
            "simulated_give_backs_calibrated": predicted["predicted_give_backs"],
            "simulated_utilisation_profile": sim_prof.utilisation,
            "jobs": {r.id: {"label": r.label, "run_s": r.run_s, "median_step_s": meas_step_s[r.id],
                            "profiled_step_s": prof_step_s[r.id],
                            "calibrated_job_s": cal_step_s[r.id] * steps[r.id], "eval_loss": r.eval_loss,
                            "strategy": pinned(sweep.state, r.id) or "local",
                            "strategy_time_over_local": {n: o.seconds for n, o in sweep.candidates.get(r.id, {}).items()}}
                     for r in rows}}


def device_holding(tasks_path: Path) -> dict:
    """What the jobs of a sharded-lrtf worker held on their device, read off its grants (each records every
    running job's engine's device bytes): the most they held together at a grant, and the sum of each job's own
    most — about what they would hold together if none gave its slots back while it waits; the give-backs."""
    records = [json.loads(ln) for ln in tasks_path.read_text().splitlines() if ln.strip()]
    grants = [r["device_bytes"] for r in records if r.get("device_bytes")]
    peak: dict[str, int] = {}
    for g in grants:
        for job, b in g.items():
            peak[job] = max(peak.get(job, 0), b)
    gave = [r.get("vacate", r.get("unstage", 0)) for r in records if "vacate" in r or "unstage" in r]
    return {"max_held_together_bytes": max((sum(g.values()) for g in grants), default=0),
            "sum_of_each_jobs_max_bytes": sum(peak.values()), "give_backs": len(gave), "given_back_bytes": sum(gave)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--segment-steps", type=int, default=5, help="lrtf's time slice, in steps")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), default=list(VARIANTS),
                    help="the schedulers to run (default: all)")
    ap.add_argument("--grad-accum", type=int, default=1, choices=[1, 2, 4],
                    help=f"micro-batches per step (of {GLOBAL_BATCH} sequences in all): 2 lets planned run a job "
                         "as replicate(2) or pipeline(2) over both slots")
    ap.add_argument("--grid", choices=list(GRIDS), default="8", help="the jobs (GRIDS)")
    ap.add_argument("--shard-blocks", type=int, default=AUTO,
                    help="sharded-lrtf: sweep.shard_blocks (0: what fits half each job's budget)")
    ap.add_argument("--device-memory", default="",
                    help='sharded-lrtf: sweep.device_memory ("": no limit on the CPU; "96MB": every waiting job '
                         "gives back, as on a full GPU)")
    ap.add_argument("--calibration", type=Path, default=DEFAULT_CACHE,
                    help="the calibration's cache file (measured and written there if absent or stale)")
    args = ap.parse_args()
    corpus = str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")
    root = Path(tempfile.mkdtemp(prefix="sweep-bench-"))
    try:
        t0 = time.perf_counter()
        # the predictions' profiles: taken once, up front beside the calibration, for every scheduler's prediction
        path = root / "predict.toml"
        path.write_text(sweep_text(root / "predict", "fifo", "checkpoint", steps=args.steps, segment_steps=0,
                                   corpus=corpus, cache=str(root / "cache"), grad_accum=args.grad_accum,
                                   grid=args.grid))
        configs = open_sweep(path, say=lambda line: None).configs
        profiles = job_profiles(configs, threads=1, cache_dir=None)
        cals: dict[str, ShapeCalibration] = {
            "plain": plain_calibration(list(configs.values()), [profiles[j] for j in configs], threads=1, slots=2,
                                       work_dir=root / "calibration", cache=args.calibration)}
        if "sharded-lrtf" in args.only:  # the sweep's own job shapes, as sharded-lrtf runs them
            # (as the sweep sets them up: stratum.sweep.setup.fit_to_budget)
            offload = [with_items(c, ("train", "engine", "offload"), ("offload", "device_budget", SHARDED_BUDGET),
                                  ("offload", "optimizer_tier", "host")) for c in configs.values()]
            cals["sharded-lrtf"] = shard_calibration(offload, [profiles[j] for j in configs], threads=1, slots=2,
                                                     shard_blocks=args.shard_blocks, work_dir=root / "calibration",
                                                     cache=args.calibration, memory=DeviceMemory(
                                                         capacity=[parse_bytes(args.device_memory)] * 2
                                                         if args.device_memory else [],
                                                         budget=parse_bytes(SHARDED_BUDGET)))
        print(f"calibration ({time.perf_counter() - t0:.1f} s): "
              + "; ".join(f"{k}: {c.describe()}" for k, c in cals.items()), flush=True)
        results = {}
        for s in args.only:
            t0 = time.perf_counter()
            results[s] = one(s, root, args, corpus, cals, profiles)
            r = results[s]
            print(f"{s:8} makespan {r['measured_makespan_s']:7.1f} s measured; SIMULATED "
                  f"{r['simulated_makespan_s_calibrated']:7.1f} s (calibrated), "
                  f"{r['simulated_makespan_s_profile']:7.1f} s (profiled step times), "
                  f"{r['simulated_makespan_s_measured_steps']:7.1f} s (measured step times)  "
                  f"[{time.perf_counter() - t0:.0f} s with profiling]", flush=True)
            ran = [f"{j}:{v['strategy']}" for j, v in r["jobs"].items() if v["strategy"] != "local"]
            offered = sorted({n for v in r["jobs"].values() for n in v["strategy_time_over_local"]} - {"local"})
            print(f"{'':8} jobs over two slots: {', '.join(ran) or 'none'} (offered: {', '.join(offered) or 'none'})",
                  flush=True)
            if (h := r["device_holding"]) is not None:
                print(f"{'':8} device: at most {h['max_held_together_bytes'] / 2**20:.1f} MiB held by all jobs at a "
                      f"grant (each job's own most, summed: {h['sum_of_each_jobs_max_bytes'] / 2**20:.1f} MiB); "
                      f"{h['give_backs']} give-backs (SIMULATED: {r['simulated_give_backs_calibrated']})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fifo = results["fifo"]["measured_makespan_s"] if "fifo" in results else float("nan")  # (nan: fifo not run)
    summary = {s: {"speedup_vs_fifo": fifo / results[s]["measured_makespan_s"],
                   "measured_over_simulated_calibrated": results[s]["measured_makespan_s"]
                   / results[s]["simulated_makespan_s_calibrated"],
                   "measured_over_simulated_measured_steps": results[s]["measured_makespan_s"]
                   / results[s]["simulated_makespan_s_measured_steps"],
                   "measured_over_simulated_profile": results[s]["measured_makespan_s"]
                   / results[s]["simulated_makespan_s_profile"]} for s in args.only}
    for s, v in summary.items():
        print(f"{s:8} {v['speedup_vs_fifo']:.2f}x fifo's throughput; measured / simulated: "
              f"{v['measured_over_simulated_calibrated']:.2f} (calibrated), "
              f"{v['measured_over_simulated_measured_steps']:.2f} (measured step times), "
              f"{v['measured_over_simulated_profile']:.2f} (profiled)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps({"steps": args.steps, "segment_steps": args.segment_steps,
                                            "shard_blocks": args.shard_blocks,
                                            "device_memory": args.device_memory, "slots": 2,
                                            "grad_accum": args.grad_accum, "grid": GRIDS[args.grid],
                                            "calibration": {k: asdict(c) for k, c in cals.items()},
                                            "results": results, "summary": summary},
                                           indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
