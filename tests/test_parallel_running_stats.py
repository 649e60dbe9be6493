"""Running statistics under replicas (parallel/running_stats.py): replicas that each run their share of a step's
micro-batches end with the BatchNorm statistics the plain engine's pass over all of them gives — for momentum
layers and cumulative ones (momentum=None), equal and unequal shares — and a forward that changes another buffer
is refused. The replicas here are threads summing through a barrier (the arithmetic, not the transport: the
gloo runs are in test_parallel_replicate.py)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from stratum.errors import StratumError
from stratum.parallel.running_stats import RunningStats


class ThreadSum:
    """``World``'s replica all-reduce for replicas that are threads of this process."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.parts: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def group(self, dim: str) -> object:
        return self

    def all_reduce(self, t: torch.Tensor, dim: str, what: str) -> torch.Tensor:
        with self.lock:
            self.parts.append(t.clone())
        self.barrier.wait()
        total = torch.stack(self.parts).sum(0)
        self.barrier.wait()
        with self.lock:
            self.parts.clear()
        self.barrier.wait()
        return t.copy_(total)


def _layer(momentum: float | None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=momentum))


def _steps(model: nn.Module, steps: list[list[torch.Tensor]]) -> None:
    model.train()
    with torch.no_grad():
        for batches in steps:
            for x in batches:
                model(x)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("counts", [[2, 2], [3, 1], [1, 2, 1]])
def test_replicas_end_with_the_plain_pass_statistics(momentum, counts):
    g = torch.Generator().manual_seed(1)
    steps = [[torch.randn(5, 3, generator=g) * (j + 1) + j for j in range(sum(counts))] for _ in range(3)]
    plain = _layer(momentum)
    _steps(plain, steps)
    world = ThreadSum(len(counts))
    replicas = [copy.deepcopy(_layer(momentum)) for _ in counts]
    errors: list[BaseException] = []

    def replica(i: int) -> None:
        try:
            stats = RunningStats([replicas[i]], world)  # type: ignore[arg-type]  # (the replica group's calls)
            start = sum(counts[:i])
            for batches in steps:
                stats.begin()
                _steps(replicas[i], [batches[start:start + counts[i]]])
                stats.combine(counts, i)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(len(counts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    want = plain[1]
    for r in replicas:
        got = r[1]
        torch.testing.assert_close(got.running_mean, want.running_mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got.running_var, want.running_var, rtol=1e-6, atol=1e-7)
        assert int(got.num_batches_tracked) == int(want.num_batches_tracked) == 3 * sum(counts)
    assert not torch.equal(replicas[0][1].running_mean, _layer(momentum)[1].running_mean)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return x


def test_another_buffer_that_training_changes_is_refused():
    world = ThreadSum(1)
    model = nn.Sequential(nn.Linear(3, 3), Counter())
    stats = RunningStats([model], world)  # type: ignore[arg-type]
    stats.begin()
    model(torch.randn(2, 3))
    with pytest.raises(StratumError, match=r"^Counter's buffer 'seen' changes in training, and replicas cannot"):
        stats.combine([1], 0)
    stats.combine([1], 0)  # checked once: the first step's refusal stops the run, the check is not repeated
