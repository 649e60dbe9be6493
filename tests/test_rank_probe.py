"""The rank probe: real gloo processes train a tiny model and report their pace and gradient all-reduce;
the spec the search prices with takes the devices' speeds and the intra-node link from them (closed forms); the
search uses it for CPU processes of this machine and keeps a given spec."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from stratum.config import ModelConfig, load_config
from stratum.errors import StratumError
from stratum.ir.hardware import Hardware, Link
from stratum.model.build import build_model
from stratum.parallel.split import split_blocks
from stratum.plan import search_cli
from stratum.plan.rank_probe import RankProbe, as_ranks_run, probe_ranks, probe_seconds, split_block_s
from stratum.plan.step_probe import probe_batches
from stratum.runtime.engine import OptimSpec

OPTIM = OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
LINK = Link(bandwidth=1e9, latency=1e-4)


def test_speeds_are_one_process_alone_over_each_rank_and_the_link_is_the_all_reduce_through_the_ring():
    hw = replace(Hardware.uniform(3, memory_bytes=2**30, intra=LINK), inter_node=LINK)  # as a probe writes it
    probe = RankProbe(alone_s=0.010, rank_s=(0.020, 0.025), allreduce_s=0.005, sharded_s=0.0125, scalar_s=4e-4,
                      grad_bytes=4_000_000)
    got = as_ranks_run(hw, probe)
    assert [d.speed for d in got.devices] == pytest.approx([0.5, 0.4, 1.0])  # the third was not probed
    # 2 ranks: T = 2(n-1)/n · N / bandwidth + 2(n-1) · latency: the scalar's 0.4 ms is 2 latencies of 0.2 ms, and
    # bandwidth = 4e6 / (5 ms - 0.4 ms)
    assert got.intra_node.latency == pytest.approx(2e-4)
    assert got.intra_node.bandwidth == pytest.approx(4e6 / 0.0046)
    assert got.sharded_scale == pytest.approx(2.5)  # the reduce-scatter and all-gather over the all-reduce
    assert got.inter_node == got.intra_node  # one machine: the spec's inter-node link is its intra-node copy
    apart = Hardware.uniform(3, memory_bytes=2**30, intra=LINK)  # an inter-node link of its own stays
    assert as_ranks_run(apart, probe).inter_node == apart.inter_node
    # an all-reduce no longer than its latencies keeps the link (nothing to read a bandwidth from)
    quick = as_ranks_run(hw, RankProbe(alone_s=0.01, rank_s=(0.01, 0.01), allreduce_s=1e-4, sharded_s=1e-4,
                                       scalar_s=2e-4, grad_bytes=8))
    assert quick.intra_node == LINK and quick.host_link == hw.host_link


def test_two_forked_ranks_report_their_pace_and_gradient_all_reduce():
    build = functools.partial(build_model, ModelConfig(preset="tiny"), tokenizer_vocab=64, seq_len=8, seed=0,
                              device=torch.device("cpu"))
    model = build()
    batches = probe_batches(64, 2, 8, 2, torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    got = probe_ranks(build, 2, batches=batches, optim=OPTIM, threads=1, timeout_s=120,
                      split_ids=tuple(split_blocks(model)))
    assert torch.get_num_threads() == before  # the alone run's threads are this process's again
    assert got.alone_s > 0 and len(got.rank_s) == 2 and all(0 < t < 5 for t in got.rank_s)
    assert got.grad_bytes == 4 * sum(p.numel() for p in model.parameters()) and 0 < got.allreduce_s < 5
    assert 0 < got.sharded_s < 5 and 0 < got.scalar_s < 5
    assert 0 < got.split_step_s[0] < got.split_step_s[1] < 5  # the layers split over the two ranks, 1 and 2 steps
    with pytest.raises(StratumError, match="at least 2 processes"):
        probe_ranks(build, 1, batches=batches, optim=OPTIM, threads=1, timeout_s=5)


def test_the_search_probes_cpu_ranks_and_keeps_one_process(corpus_file, cache_dir, monkeypatch):
    cfg = load_config(None, [f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}",
                             "model.preset='tiny'", "data.seq_len=16", "train.micro_batch_size=2",
                             "train.grad_accum=4"])
    spec = Hardware.uniform(2, memory_bytes=2**30, intra=LINK)
    asked = {}

    def ranks(build, n, *, batches, optim, threads, timeout_s, split_ids):
        asked.update(n=n, micro_batches=len(batches), threads=threads, split_ids=split_ids)
        # one more micro-batch's split step a second longer: DTensor's cost per block well above nothing whatever
        # the blocks' measured times (a smaller gap leaves none under load, and the step probe's stands)
        return RankProbe(alone_s=0.01, rank_s=(0.02, 0.02), allreduce_s=0.002, sharded_s=0.004, scalar_s=2e-4,
                         grad_bytes=1000, split_step_s=(0.05, 1.05))
    monkeypatch.setattr(search_cli, "machine_hardware", lambda cfg, n: spec)
    monkeypatch.setattr(search_cli, "probe_ranks", ranks)
    work = search_cli.workload(cfg, search_cli._meta_model(cfg), None)
    got, priced = search_cli.machine_ranks(cfg, 2, work)
    assert [d.speed for d in got.devices] == [0.5, 0.5] and got.sharded_scale == 2
    assert got.shared_cores >= 1  # the processes share this machine's cores (a spec cached without it too)
    assert asked["n"] == 2 and asked["micro_batches"] == 2 and asked["threads"] >= 1
    assert asked["split_ids"] == work.splittable != ()  # tiny's layers split 2 ways: measured over the ranks
    assert priced.step.split_block_s > 0.1 > work.step.split_block_s and priced.step.fixed_s == work.step.fixed_s
    assert search_cli.machine_ranks(cfg, 1, work) == (spec, work)  # one process: nothing to probe
    # a model whose steps would hold the search past the probe's budget is not probed: the spec stands
    asked.clear()
    monkeypatch.setattr(search_cli, "PROBE_BUDGET_S", 1e-6)
    assert search_cli.machine_ranks(cfg, 2, work) == (spec, work) and asked == {}


def test_the_probes_length_is_its_steps_at_the_shared_pace():
    # alone: WARMUP + STEPS steps; together (2 processes on 1 core: half pace) the same, and the split steps'
    assert probe_seconds(0.1, 2, 2) == pytest.approx(0.1 * (19 + 19 + 22))
    assert probe_seconds(0.1, 2, 1) == pytest.approx(0.1 * (19 + 2 * (19 + 22)))


def test_dtensors_cost_per_split_layer_is_what_one_more_micro_batch_leaves_over():
    # 2 ranks at speed 0.5; alone a micro-batch takes 10 ms, 6 ms of it in the 2 split layers: a rank runs
    # (10 - 6/2) / 0.5 = 14 ms of it; one more micro-batch of the split step takes 30 ms: 16 ms left over, 8 ms a
    # layer, less its priced all-reduces (3 ms): 5 ms at the rank's pace, 2.5 ms on the profiled device
    probe = RankProbe(alone_s=0.010, rank_s=(0.02, 0.02), allreduce_s=0.005, sharded_s=0.01, scalar_s=1e-4,
                      grad_bytes=1, split_step_s=(0.05, 0.08))
    assert split_block_s(probe, split_blocks_s=0.006, blocks=2, comm_s=0.003, speed=0.5) == pytest.approx(0.0025)
    assert split_block_s(probe, split_blocks_s=0.006, blocks=2, comm_s=0.02, speed=0.5) == 0.0  # load: nothing left
    unmeasured = RankProbe(alone_s=0.01, rank_s=(0.02, 0.02), allreduce_s=0.005, sharded_s=0.01, scalar_s=1e-4,
                           grad_bytes=1)
    assert split_block_s(unmeasured, split_blocks_s=0.006, blocks=2, comm_s=0.003, speed=0.5) == 0.0
