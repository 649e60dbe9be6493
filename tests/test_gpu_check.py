"""The GPU session's tools, checked on a CPU: the peak table behind MFU, the batch search of the seeds' settings, and
benchmarks/gpu_check.sh's dry run (DEVICE=cpu, tiny sizes) of its cheapest benchmark part, end to end."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from stratum.errors import StratumError
from stratum.runtime.peak import Peak, device_peak, mfu, published_peak

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def batch_fit(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("batch_fit")


@pytest.mark.parametrize(("name", "kind", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),  # the SXM part, as torch names it
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA A10", "bf16", 125.0),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp32", 14.0),
    ("NVIDIA A10G", "bf16", None),  # not in the table: measured instead
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 units: measured
])
def test_published_peaks_are_looked_up_by_the_name_torch_reports(name, kind, tflops):
    peak = published_peak(name, kind)
    if tflops is None:
        assert peak is None
    else:
        assert peak is not None and peak.flops == pytest.approx(tflops * 1e12)
        assert peak.source.startswith("published: ") and kind in peak.source


def test_a_cpu_peak_is_measured_and_labelled_so():
    peak = device_peak(torch.device("cpu"), "fp32")
    assert peak.source.startswith("measured: ") and "float32" in peak.source and peak.flops > 1e8
    # MFU is the model's FLOPs at the measured rate over the peak
    assert mfu(6e9, 100.0, Peak(flops=1.2e12, source="x")) == pytest.approx(0.5)


class _FitsUpTo:
    """An engine whose step runs out of device memory above ``limit`` sequences (or fails otherwise)."""

    def __init__(self, limit: int, error: type[Exception] = torch.cuda.OutOfMemoryError):
        self.limit, self.error, self.sizes = limit, error, []

    def train_step(self, micro_batches, lr):
        n = micro_batches[0].x.shape[0]
        self.sizes.append(n)
        if n > self.limit:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_the_batch_search_doubles_until_out_of_memory_and_backs_off(batch_fit):
    cpu = torch.device("cpu")
    engine = _FitsUpTo(12)
    micro, tried = batch_fit.largest_micro_batch(engine, 256, 32, cpu, cap=64)
    assert micro == 8 and engine.sizes == [1, 2, 4, 8, 16]
    assert tried[-1] == {"micro_batch": 16, "fits": False, "peak_bytes": None} and all(t["fits"] for t in tried[:-1])
    assert batch_fit.largest_micro_batch(_FitsUpTo(100), 256, 32, cpu, cap=4)[0] == 4
    # a size whose step peaks above the limit does not fit (a CPU reads a peak of 0, so a limit below 0 fails all)
    assert batch_fit.largest_micro_batch(_FitsUpTo(100), 256, 32, cpu, cap=4, limit_bytes=0)[0] == 4
    with pytest.raises(StratumError, match="cannot train one sequence"):
        batch_fit.largest_micro_batch(_FitsUpTo(100), 256, 32, cpu, cap=4, limit_bytes=-1)
    with pytest.raises(StratumError, match="cannot train one sequence"):
        batch_fit.largest_micro_batch(_FitsUpTo(0), 256, 32, cpu, cap=64)
    with pytest.raises(ValueError):  # anything but an allocation failure is the engine's error, not a size limit
        batch_fit.largest_micro_batch(_FitsUpTo(4, ValueError), 256, 32, cpu, cap=64)
    # accumulation to the nearest whole number of micro-batches per target step, at least one
    assert batch_fit.accumulation(262144, 32, 1024) == 8 and batch_fit.accumulation(0, 32, 1024) == 1


def test_the_gpu_check_dry_run_runs_a_benchmark_part_end_to_end(tmp_path, cache_dir):
    env = {**os.environ, "DEVICE": "cpu", "PY": sys.executable, "LOG": str(tmp_path / "log"),
           "OUT": str(tmp_path / "out"), "PRESET": "tiny", "STEPS": "1", "WARMUP": "1", "MAX_MICRO": "2",
           "TOKENS": "256", "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(cache_dir)}
    p = subprocess.run(["bash", "benchmarks/gpu_check.sh", "overhead"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "log" / "offload_overhead_cpu.json").read_text())
    assert res["micro_batch"] == 2 and res["grad_accum"] == 2 and res["tokens_per_step"] == 256
    assert [t["micro_batch"] for t in res["batch_search"]] == [1, 2]
    assert set(res["mfu"]) == {"plain", "offload"} and res["peak"]["source"].startswith("measured: ")
    # on a CPU both engines, and the plain engine run again from the same weights, give the same losses bit for bit
    assert res["losses_equal"] and res["plain_again_max_rel_loss_diff"] == 0.0
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "== overhead" in summary and "rc=0" in summary and "overhead tiny: micro-batch 2 x 2 x 64" in summary
    with tarfile.open(tmp_path / "out" / "gpu-check.tar.gz") as tar:
        assert "log/offload_overhead_cpu.json" in tar.getnames()
    bad = subprocess.run(["bash", "benchmarks/gpu_check.sh", "benchmark"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "unknown part 'benchmark' (session session2 check" in bad.stderr
