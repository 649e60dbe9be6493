"""A job's candidate strategies for the ``planned`` scheduler: Plan trees over 1..k devices with their predicted
time and peak memory on a described cluster, from the one cost model.

``local``, ``replicate(k)`` and ``pipeline(k)`` are priced by :func:`stratum.plan.predict.predict` (the profile's
block costs over the devices' speed, ring all-reduces, the pipeline simulator's makespan and peak activations);
a plan whose ranks do not fit their device memory, or that the model cannot run (micro-batches that do not divide
over the replicas), is not a candidate. ``offload`` is one device streaming the job's blocks from the host as
Hydra's shards do (:func:`streamed_tasks_s`: each task the longer of its compute and its transfer, double-buffered;
the offload planner's own finer prediction needs the built model), holding the saved activations and two shards'
parameters and gradients on the device.
"""

from __future__ import annotations

from stratum.errors import StratumError
from stratum.ir.hardware import Hardware
from stratum.ir.plan import parse_plan
from stratum.ir.prices import transfer_s
from stratum.plan.predict import Workload, predict
from stratum.profile.profile import Profile
from stratum.sweep.gang import Option


def candidate_plans(max_devices: int) -> list[str]:
    """The plan expressions tried: local, then replicate(k) and pipeline(k) for k = 2..max_devices."""
    return ["local"] + [f"{kind}({k})" for k in range(2, max_devices + 1) for kind in ("replicate", "pipeline")]


def job_options(profile: Profile, *, microbatches: int, steps: int, hw: Hardware, max_devices: int,
                shard_blocks: int = 1) -> dict[str, Option]:
    """Plan expression (or ``offload``, streaming shards of ``shard_blocks`` blocks) → the job's predicted time to
    its end and peak bytes per device, for every candidate that fits; raises StratumError when none does."""
    work = Workload(profile=profile, microbatches=microbatches)
    out: dict[str, Option] = {}
    for text in candidate_plans(min(max_devices, hw.num_devices)):
        plan = parse_plan(text)
        try:
            pred = predict(plan, work, hw)
        except StratumError:  # the model or the step cannot run this way (e.g. micro-batches over replicas)
            continue
        if pred.fits:
            out[text] = Option(seconds=pred.step_s * steps, devices=plan.world_size(), peak_bytes=max(pred.peak_bytes))
    try:
        out["offload"] = offload_option(profile, microbatches=microbatches, steps=steps, hw=hw,
                                        shard_blocks=shard_blocks)
    except StratumError:
        if not out:
            raise
    return out


def offload_option(profile: Profile, *, microbatches: int, steps: int, hw: Hardware,
                   shard_blocks: int = 1) -> Option:
    """One device streaming the job's shards from the host (:func:`streamed_step_s`); an error if even that does
    not fit."""
    dev = hw.devices[0]
    peak = sum(b.act_saved_bytes for b in profile.blocks) + 2 * max(
        sum(b.param_bytes + b.grad_bytes for b in profile.blocks[i:i + shard_blocks])
        for i in range(0, len(profile.blocks), shard_blocks))
    if peak > dev.memory_bytes:
        raise StratumError(f"{profile.model}: even streamed from the host it needs {peak} bytes on a device of "
                           f"{dev.memory_bytes}")
    step = sum(streamed_tasks_s(profile, hw, shard_blocks)) * microbatches
    return Option(seconds=step * steps, devices=1, peak_bytes=peak)


def streamed_tasks_s(profile: Profile, hw: Hardware, shard_blocks: int) -> list[float]:
    """Seconds of one micro-batch's shard tasks when the shards stream from the host, double-buffered (Hydra): the
    forward of each shard of ``shard_blocks`` blocks, then the backwards in reverse; a task takes the longer of
    its compute (over the device's speed) and its transfer — the shard's parameters in (and, in the backward,
    its gradients out) over the host link."""
    speed = hw.devices[0].speed
    groups = [profile.blocks[i:i + shard_blocks] for i in range(0, len(profile.blocks), shard_blocks)]
    fwd, bwd = [], []
    for g in groups:
        params_in = transfer_s(sum(b.param_bytes for b in g), hw.host_link)
        grads_out = transfer_s(sum(b.grad_bytes for b in g), hw.host_link)
        fwd.append(max(sum(b.fwd_s for b in g) / speed, params_in))
        bwd.append(max(sum(b.bwd_s for b in g) / speed, params_in + grads_out))
    return fwd + bwd[::-1]
