"""A trace replayed under one or more policies on a hardware spec: the simulator's entry point for the CLI and
the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stratum.cluster.burst import Burst, BurstMultiplex
from stratum.cluster.cluster import Cluster
from stratum.cluster.models import ModelCosts, preset_costs
from stratum.cluster.policies import Elastic, ElasticDevices, Policy, StaticDP
from stratum.cluster.simulate import SimResult, simulate
from stratum.cluster.trace import Job
from stratum.errors import StratumError
from stratum.ir.hardware import Hardware

POLICIES = ("static-dp", "burst", "burst+multiplex", "elastic", "elastic-devices")


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """The policies' knobs."""

    amplification: float = 2.0
    """Burst plans: a block may use at most this many times its one-device device-seconds (DeepPool's limit)."""
    interference: float = 0.1
    """burst+multiplex: background work gets this fraction less of the idle time it fills, and a foreground job
    hosting it steps this fraction slower."""
    startup_s: float = 30.0
    """elastic, elastic-devices: seconds a restarted job's processes take to start (launch, CUDA and communicator
    set-up, data
    loader) before it trains again, on top of moving its state over the host link."""

    def __post_init__(self) -> None:
        if not self.amplification >= 1 or math.isinf(self.amplification):
            raise StratumError(f"amplification must be a number >= 1, got {self.amplification}")
        if not 0 <= self.interference < 1:
            raise StratumError(f"interference must be in [0, 1), got {self.interference}")
        if not 0 <= self.startup_s < math.inf:
            raise StratumError(f"restart start-up must be a time >= 0 seconds, got {self.startup_s}")


def parse_policies(text: str) -> list[str]:
    """``static-dp``, a comma-separated list, or ``all``."""
    names = list(POLICIES) if text.strip() == "all" else [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise StratumError(f"unknown policy {bad[0] if bad else text!r}; choose from {', '.join(POLICIES)} "
                           "(comma-separated) or all")
    if twice := sorted({p for p in names if names.count(p) > 1}):
        raise StratumError(f"policy {twice[0]!r} is given twice in --policy {text!r}")
    return names


def make_policy(name: str, cluster: Cluster, config: PolicyConfig) -> Policy:
    if name == "static-dp":
        return StaticDP(cluster)
    if name == "elastic":
        return Elastic(cluster, startup_s=config.startup_s)
    if name == "elastic-devices":
        return ElasticDevices(cluster, startup_s=config.startup_s)
    if name == "burst":
        return Burst(cluster, amplification=config.amplification)
    if name == "burst+multiplex":
        return BurstMultiplex(cluster, amplification=config.amplification, interference=config.interference)
    raise StratumError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")


def trace_costs(jobs: Sequence[Job], cache_dir: Path) -> dict[tuple[str, int], ModelCosts]:
    """Model costs for every (model, seq_len) the jobs name, measured once and cached (:mod:`.models`)."""
    out = {}
    for job in jobs:
        key = (job.model, job.seq_len)
        if key not in out:
            try:
                out[key] = preset_costs(key[0], seq_len=key[1], cache_dir=cache_dir)
            except StratumError as e:
                raise StratumError(f"job {job.id!r} ({job.model}, seq_len {job.seq_len}): {e}; set the trace's "
                                   "seq_len column or choose another model") from None
    return out


def replay(hw: Hardware, jobs: Sequence[Job], costs: Mapping[tuple[str, int], ModelCosts], policies: Sequence[str],
           *, config: PolicyConfig = PolicyConfig(), until_s: float = math.inf) -> list[SimResult]:
    """``jobs`` under each policy (SIMULATED)."""
    cluster = Cluster.of(hw, jobs, costs)
    return [simulate(jobs, cluster, make_policy(p, cluster, config), until_s=until_s) for p in policies]
