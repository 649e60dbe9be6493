"""The step's costs outside its blocks: the formulas on hand-computed timings, and a real measurement on a tiny
model gives figures the cost model takes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from stratum.config import ModelConfig
from stratum.ir.costs import StepCosts
from stratum.model.build import build_model
from stratum.plan.step_probe import measure_step_costs, step_costs_from
from stratum.profile.profiler import profile_blockseq
from stratum.runtime.engine import OptimSpec


def test_the_costs_outside_the_blocks_are_what_the_steps_leave_over():
    # T(1) = 50 ms, T(2) = 80 ms, blocks 20 ms a micro-batch, update 5 ms:
    # per micro-batch 80 − 50 − 20 = 10 ms; fixed 50 − 20 − 10 − 5 = 15 ms
    got = step_costs_from(0.05, 0.08, blocks_s=0.02, update_s=0.005)
    assert got.per_microbatch_s == pytest.approx(0.01) and got.fixed_s == pytest.approx(0.015)
    # a load that made the blocks look slower than the steps leaves nothing, not a negative cost
    assert step_costs_from(0.05, 0.06, blocks_s=0.03, update_s=0.03) == StepCosts()
    # its 2 layers under DTensor: S(1) = 70 ms, S(2) = 110 ms: per split block (40 − 30) / 2 = 5 ms a micro-batch;
    # split's fixed part 70 − 50 − 2 · 5 = 10 ms
    got = step_costs_from(0.05, 0.08, blocks_s=0.02, update_s=0.005, split=[0.07, 0.11], split_blocks=2)
    assert got.split_block_s == pytest.approx(0.005) and got.split_fixed_s == pytest.approx(0.01)
    assert got.fixed_s == pytest.approx(0.015)
    # as a one-process pipeline: Z(1) = 60 ms, Z(2) = 110 ms: one more micro-batch's six actions cost
    # 110 − 60 − 20 = 30 ms beyond its blocks, 5 ms each
    got = step_costs_from(0.05, 0.08, blocks_s=0.02, update_s=0.005, pipeline=[0.06, 0.11])
    assert got.per_action_s == pytest.approx(0.005) and got.per_microbatch_s == pytest.approx(0.01)


def test_a_tiny_model_measures_costs_the_cost_model_takes_and_leaves_the_rng_alone():
    cpu = torch.device("cpu")
    model = build_model(ModelConfig(preset="tiny"), tokenizer_vocab=64, seq_len=8, seed=0, device=cpu)
    prof = profile_blockseq(model, micro_batch=2, seq_len=8, device=cpu, runs=2)
    torch.manual_seed(3)
    before = torch.rand(1)
    copy = build_model(ModelConfig(preset="tiny"), tokenizer_vocab=64, seq_len=8, seed=0, device=cpu)
    torch.manual_seed(3)
    got = measure_step_costs(model, split_copy=copy, profile=prof, vocab=64, micro_batch=2, seq_len=8, device=cpu,
                             update_s=0.0, repeats=2,
                             optim=OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0))
    assert torch.rand(1) == before
    assert not dist.is_initialized()  # the probe's world of one is gone
    assert any(isinstance(p, DTensor) for p in copy.parameters())  # the copy's layers ran under DTensor
    figures = [got.fixed_s, got.per_microbatch_s, got.split_block_s, got.split_fixed_s, got.per_action_s]
    assert all(0 <= x < 5.0 for x in figures)  # seconds: a tiny model's step is far quicker
    assert 0 < got.block_scale < 100  # the blocks re-timed against the profile of the same blocks
