"""The device's peak FLOP/s, the denominator of model FLOPs utilisation (MFU): a known GPU's published dense rate
for the precision trained in, else a matrix product's rate measured on the device (labelled as measured)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from stratum.runtime.device import HALF_DTYPES, compute_rate

# Dense (no 2:4 sparsity) tensor-core rates in TFLOP/s from the vendor's datasheets; where a datasheet gives only
# the sparse figure, half of it. "fp32" is the plain CUDA-core rate (torch's default for float32 matrix products);
# "tf32" applies where torch.backends.cuda.matmul.allow_tf32 is on. Sources:
#   H100 SXM5 / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100)
#   H200 SXM / NVL: NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200)
#   A100 SXM4 / PCIe, 40 and 80 GB: NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100)
#   L40S: NVIDIA L40S datasheet; L4: NVIDIA L4 Tensor Core GPU datasheet; A10: NVIDIA A10 datasheet
#   V100 SXM2 / PCIe: NVIDIA Tesla V100 datasheet (no bf16 or tf32 units)
# torch.cuda.get_device_name spells the SXM parts without the form factor ("NVIDIA H100 80GB HBM3", "NVIDIA H200"),
# so the NVL and PCIe patterns come before the bare names; the first pattern that matches wins.
PUBLISHED: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H100.*NVL", "H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100.*PCIe", "H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H100", "H100 SXM5", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"H200.*NVL", "H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H200", "H200 SXM", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", "L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", "L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", "A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"V100.*PCIE", "V100 PCIe", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", "V100 SXM2", {"fp16": 125.0, "fp32": 15.7}),
)


@dataclass(frozen=True, kw_only=True)
class Peak:
    """A device's peak rate for one precision, and where the figure comes from."""

    flops: float
    """Peak FLOP/s."""
    source: str
    """"published: <part> datasheet, dense <precision>" or "measured: <what was timed>"."""

    def to_dict(self) -> dict:
        return {"flops": self.flops, "source": self.source}


def matmul_kind(precision: str) -> str:
    """The datasheet column a training precision's matrix products run at: bf16/fp16 under autocast; fp32 as
    tf32 where torch allows it, else plain fp32."""
    if precision in HALF_DTYPES:
        return precision
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def published_peak(device_name: str, kind: str) -> Peak | None:
    """The datasheet's dense rate of ``kind`` (bf16, fp16, tf32, fp32) for a GPU named ``device_name``, or None
    for a device not in the table or a precision its datasheet does not give."""
    for pattern, part, rates in PUBLISHED:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if kind not in rates:
                return None
            return Peak(flops=rates[kind] * 1e12, source=f"published: {part} datasheet, dense {kind}")
    return None


def measured_peak(device: torch.device, dtype: torch.dtype, n: int, seconds: float = 0.5) -> Peak:
    """The rate of ``n``×``n``×``n`` matrix products in ``dtype`` on ``device`` (``compute_rate``, for about
    ``seconds``)."""
    name = str(dtype).removeprefix("torch.")
    return Peak(flops=compute_rate(device, seconds=seconds, n=n, dtype=dtype) * 1e9,
                source=f"measured: {n}x{n}x{n} {name} matrix products on {device.type} for {seconds:g} s")


def device_peak(device: torch.device, precision: str) -> Peak:
    """The peak for MFU on ``device`` training in ``precision``: published for a GPU in the table, else measured
    (a CPU, an unknown GPU, a precision the datasheet lacks) in that precision and in fp32, the faster."""
    kind = matmul_kind(precision)
    if device.type == "cuda":
        known = published_peak(torch.cuda.get_device_name(device), kind)
        if known is not None:
            return known
    n = 8192 if device.type == "cuda" else 1024
    # A device with no fast 16-bit path (most CPUs) could train in fp32 instead: the better of the two is its peak.
    dtypes = {HALF_DTYPES.get(precision, torch.float32), torch.float32}
    return max((measured_peak(device, d, n) for d in dtypes), key=lambda p: p.flops)


def mfu(flops_per_token: float, tokens_per_s: float, peak: Peak) -> float:
    """Model FLOPs utilisation: the model's training FLOPs per token (BlockSeq.flops_per_token) at the measured
    tokens/s, over the peak."""
    return flops_per_token * tokens_per_s / peak.flops
