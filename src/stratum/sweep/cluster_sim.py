"""SIMULATED sweeps on a described cluster (a ``[hardware]`` spec, :mod:`stratum.ir.hardware`): each scheduler
over the jobs' profiles, with memory and several-device strategies.

- ``fifo``: each job on one device in sweep order, its fastest one-device strategy (``local`` where it fits the
  device's memory, else ``offload``).
- ``sharded-lrtf``: every job streams its shards from the host (:func:`stratum.sweep.strategies.streamed_tasks_s`)
  as a chain of tasks; a freed device takes the task of the job with the longest remaining time.
- ``planned``: the joint plan over each job's candidates (:func:`stratum.sweep.strategies.job_options`: local,
  replicate(k), pipeline(k), offload) — option, devices and start (:func:`stratum.sweep.gang.plan_gang`).

Devices are taken as identical (the first one's memory and speed). Nothing runs; figures are SIMULATED.
"""

from __future__ import annotations

from dataclasses import dataclass

from stratum.errors import StratumError
from stratum.ir.hardware import Hardware
from stratum.profile.profile import Profile
from stratum.sweep.gang import plan_gang
from stratum.sweep.gang_plan import GangPlan, Option
from stratum.sweep.shard_lrtf import sharded_lrtf
from stratum.sweep.shard_size import AUTO, device_shard_blocks
from stratum.sweep.simulate import SimResult, plan_schedule, simulate
from stratum.sweep.strategies import check_host_holds, job_options, streamed_tasks_s


@dataclass(frozen=True, kw_only=True)
class ClusterJob:
    """A job as the cluster simulation sees it."""

    profile: Profile
    """Its model's per-block costs per micro-batch (times on the device the speeds are relative to)."""
    microbatches: int
    """Micro-batches per optimizer step."""
    steps: int
    """Optimizer steps."""


@dataclass(kw_only=True)
class ClusterSim:
    results: dict[str, SimResult]
    """Scheduler → its simulated schedule."""
    options: dict[str, dict[str, Option]]
    """Job → its candidate strategies."""
    plan: GangPlan
    """The planned scheduler's joint plan."""
    shard_blocks: dict[str, int]
    """Job → blocks per shard of its streamed strategies (offload, sharded-lrtf)."""


def simulate_cluster(jobs: dict[str, ClusterJob], hw: Hardware, *, shard_blocks: int,
                     time_limit_s: float, gap: float = 0.0) -> ClusterSim:
    """fifo, sharded-lrtf (shards of ``shard_blocks`` blocks; 0: what half a device holds beside the job's
    activations, per job) and planned on ``hw``."""
    n = hw.num_devices
    blocks = {j: shard_blocks if shard_blocks != AUTO else device_shard_blocks(c.profile, hw.devices[0].memory_bytes)
              for j, c in jobs.items()}
    options = {j: job_options(c.profile, microbatches=c.microbatches, steps=c.steps, hw=hw, max_devices=n,
                              shard_blocks=blocks[j]) for j, c in jobs.items()}
    for j, opts in options.items():
        if not any(o.devices == 1 for o in opts.values()):
            raise StratumError(f"{j}: fits no single device of the hardware, even streaming its blocks from the "
                               f"host (it fits only as {', '.join(opts)}); fifo and sharded-lrtf run a job on "
                               "one device: give the devices more memory or the job a smaller micro-batch")
    one = {j: min(o.seconds for o in opts.values() if o.devices == 1) for j, opts in options.items()}
    fifo = simulate("fifo", {j: 1 for j in jobs}, one, slots=n)
    for c in jobs.values():  # (every job streams from the host under sharded-lrtf)
        check_host_holds(c.profile, hw)
    chains = {j: streamed_tasks_s(c.profile, hw, blocks[j]) * (c.microbatches * c.steps) for j, c in jobs.items()}
    tasks = sharded_lrtf(chains, n)
    span = max((t.end for t in tasks), default=0.0)
    hydra = SimResult(runs=[(t.start, t.slot, t.job, t.end) for t in tasks], makespan=span,
                      utilisation=sum(sum(c) for c in chains.values()) / (n * span) if span else 0.0)
    plan = plan_gang(options, [0.0] * n, time_limit_s=time_limit_s, gap=gap)
    return ClusterSim(results={"fifo": fifo, "sharded-lrtf": hydra, "planned": plan_schedule(plan, n)},
                      options=options, plan=plan, shard_blocks=blocks)
