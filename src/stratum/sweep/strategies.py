"""A job's candidate strategies for the ``planned`` scheduler: Plan trees over 1..k devices with their predicted
time and peak memory on a described cluster, from the one cost model.

``local``, ``replicate(k)`` and ``pipeline(k)`` are priced by :func:`stratum.plan.predict.predict` (the profile's
block costs over the devices' speed, ring all-reduces, the pipeline simulator's makespan and peak activations);
a plan whose ranks do not fit their device memory, or that the model cannot run (micro-batches that do not divide
over the replicas), is not a candidate. ``offload`` is one device streaming the job's blocks from the host as
Hydra's shards do (:func:`streamed_tasks_s`: each task the longer of its compute and its transfer, double-buffered;
the offload planner's own finer prediction needs the built model), holding the saved activations and two shards'
parameters and gradients on the device.

The local runner's planned scheduler offers each job ``local`` and ``replicate(k)``/``pipeline(k)`` over k of
its slots (:func:`relative_options`): a strategy's time is the job's own predicted local time (measured, or
calibrated: its shape's measured seconds alone, as the strategy has the slots to itself, :func:`scaled`) times
the cost model's step-time ratio of that plan to ``local`` on this machine's slots, for the same steps — what the
runner then runs with :func:`plan_overrides`. A plan over several slots is not itself calibrated: the ratio and
the measured start-up of a multi-process run (:mod:`stratum.sweep.launch_cost`) price it.
"""

from __future__ import annotations

from dataclasses import replace

from stratum.config import Config
from stratum.errors import StratumError
from stratum.ir.hardware import Hardware
from stratum.ir.plan import parse_plan
from stratum.ir.prices import transfer_s
from stratum.plan.predict import Workload, predict
from stratum.profile.profile import Profile
from stratum.sweep.gang_plan import Option
from stratum.sweep.spec import SweepSettings
from stratum.units import fmt_bytes


def candidate_plans(max_devices: int, *, microbatches: int | None = None, blocks: int | None = None) -> list[str]:
    """The plan expressions tried: local, then replicate(k) and pipeline(k) for k = 2..max_devices — replicas
    no more than the step's micro-batches, stages no more than the model's blocks, where they are given (a
    thousand-device cluster offers a job no more than it can use)."""
    most = {"replicate": microbatches or max_devices, "pipeline": blocks or max_devices}
    return ["local"] + [f"{kind}({k})" for k in range(2, max_devices + 1) for kind in most if k <= most[kind]]


def job_options(profile: Profile, *, microbatches: int, steps: int, hw: Hardware, max_devices: int,
                shard_blocks: int = 1) -> dict[str, Option]:
    """Plan expression (or ``offload``, streaming shards of ``shard_blocks`` blocks) → the job's predicted time to
    its end and peak bytes per device, for every candidate that fits; raises StratumError when none does."""
    work = Workload(profile=profile, microbatches=microbatches)
    out: dict[str, Option] = {}
    for text in candidate_plans(min(max_devices, hw.num_devices), microbatches=microbatches,
                                blocks=len(profile.blocks)):
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
    check_host_holds(profile, hw)
    peak = sum(b.act_saved_bytes for b in profile.blocks) + 2 * max(
        sum(b.param_bytes + b.grad_bytes for b in profile.blocks[i:i + shard_blocks])
        for i in range(0, len(profile.blocks), shard_blocks))
    if peak > dev.memory_bytes:
        raise StratumError(f"{profile.model}: even streamed from the host it needs {peak} bytes on a device of "
                           f"{dev.memory_bytes}")
    step = sum(streamed_tasks_s(profile, hw, shard_blocks)) * microbatches
    return Option(seconds=step * steps, devices=1, peak_bytes=peak)


def check_host_holds(profile: Profile, hw: Hardware) -> None:
    """A job streamed from the host keeps its training state there (parameters, gradients, optimizer state):
    an error where the host cannot hold it."""
    state = profile.train_state_bytes
    if state > hw.host_bytes:
        raise StratumError(f"{profile.model}: streamed from the host it keeps {fmt_bytes(state)} of training state "
                           f"there, and the hardware's host holds {fmt_bytes(hw.host_bytes)}: give [hardware] "
                           "host_bytes its real size")


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


# ---- the local runner's strategies ---------------------------------------------------------------------------
def sweep_plans(s: SweepSettings) -> list[str]:
    """The strategies the planned scheduler chooses between for each job: sweep.plans, or by default ``local``
    and, where a job may hold several slots (CPU slots, checkpoint slices), replicate(k) and pipeline(k) for
    k = 2..slots. (GPU slots take them from sweep.plans only: their prices would come from this machine's probe
    of its CPU processes.)"""
    if s.plans:
        return list(s.plans)
    multi = all(d == "cpu" for d in s.devices) and s.slice_by == "checkpoint"
    return candidate_plans(s.slots) if multi else ["local"]


def plan_overrides(text: str, cfg: Config, threads: int) -> list[str]:
    """The config overrides that run ``cfg``'s job as the strategy ``text`` with the same global batch (the
    replicas share the step's micro-batches) and ``threads`` torch threads per process; [] for local."""
    if text == "local":
        return []
    plan = parse_plan(text)
    accum = cfg.train.grad_accum
    if accum % plan.replicas:
        raise StratumError(f"{text}: train.grad_accum = {accum} micro-batches do not divide over "
                           f"{plan.replicas} replicas")
    return [f"parallel.plan={text!r}", f"train.grad_accum={accum // plan.replicas}", f"train.threads={threads}"]


def relative_options(profile: Profile, cfg: Config, plans: list[str], hw: Hardware | None) -> dict[str, Option]:
    """Each strategy of ``plans`` the job can run as, with its predicted time as a multiple of its ``local``
    time (the cost model's step time over local's on ``hw``, the slots as devices; ``hw`` may be None when
    ``plans`` is only local). A strategy the model cannot run (micro-batches that do not divide over replicas,
    fewer blocks than stages), that does not fit, or that is predicted no faster than local (where local is
    offered) is left out."""
    work = Workload(profile=profile, microbatches=cfg.micro_batches_per_step)
    out: dict[str, Option] = {}
    local_s = predict(parse_plan("local"), work, hw).step_s if hw is not None else 0.0
    for text in plans:
        if text == "local":
            out[text] = Option(seconds=1.0, devices=1)
            continue
        assert hw is not None  # (a multi-slot strategy is priced on the slots)
        try:
            plan_overrides(text, cfg, 1)
            pred = predict(parse_plan(text), work, hw)
        except StratumError:
            continue
        if pred.fits and local_s > 0:
            out[text] = Option(seconds=pred.step_s / local_s, devices=pred.plan.world_size(),
                               peak_bytes=max(pred.peak_bytes))
    if "local" in out:  # a plan over more slots that is no faster than one slot never shortens a schedule
        out = {n: o for n, o in out.items() if n == "local" or o.seconds < 1.0}
    return out


def scaled(options: dict[str, Option], local_s: float, share: float = 1.0) -> dict[str, Option]:
    """``relative_options`` in seconds, for a job whose local run has ``local_s`` seconds left beside other jobs
    and ``share`` of that alone: a strategy over several slots holds the machine to itself, so its ratio applies
    to the job's time alone."""
    return {n: replace(o, seconds=o.seconds * local_s * (share if o.devices > 1 else 1.0))
            for n, o in options.items()}
