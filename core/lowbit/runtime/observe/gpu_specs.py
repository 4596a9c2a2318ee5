"""What lowbit knows about a device's speed: dense tensor-core peaks and memory bandwidth.

One table, read by the throughput meter (MFU) and the FP8 payoff prediction. Each figure is the
vendor's datasheet figure without sparsity (datasheets quote FP8/FP4 "with sparsity", twice the
dense rate); the source is on each row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePeak:
    """A device's dense peak: ``tflops`` is a GPU's bf16 tensor-core peak, or a CPU's GEMM rate
    measured in the run's compute dtype; ``fp8_tflops`` / ``fp4_tflops`` the FP8 / FP4 peaks where
    there are such tensor cores; ``memory_tbps`` the DRAM bandwidth in TB/s (None: not known)."""

    name: str
    tflops: float
    fp8_tflops: float | None
    source: str
    fp4_tflops: float | None = None
    memory_tbps: float | None = None


# Matched against torch.cuda.get_device_name() word by word, in this order (the more specific name
# first): "NVIDIA L40" is not an L4, nor "NVIDIA GH200" an H200.
GPU_PEAKS = (
    DevicePeak(
        "H100 PCIe",
        756.0,
        1513.0,
        "NVIDIA H100 datasheet (PCIe: 1513 bf16 / 3026 fp8 with sparsity; 2.0 TB/s)",
        memory_tbps=2.0,
    ),
    DevicePeak(
        "H100 NVL",
        835.5,
        1670.5,
        "NVIDIA H100 datasheet (NVL: 1671 bf16 / 3341 fp8 with sparsity; 3.9 TB/s)",
        memory_tbps=3.9,
    ),
    DevicePeak(
        "H100",
        989.4,
        1978.9,
        "NVIDIA H100 datasheet (SXM: 1979 bf16 / 3958 fp8 with sparsity; 3.35 TB/s)",
        memory_tbps=3.35,
    ),
    DevicePeak("H200", 989.4, 1978.9, "NVIDIA H200 datasheet (the H100 SXM's tensor cores; 4.8 TB/s)", memory_tbps=4.8),
    DevicePeak(
        "GB200",
        2500.0,
        5000.0,
        "NVIDIA GB200 NVL72 datasheet (360 PF bf16 / 720 PF fp8 / 1440 PF fp4 sparse and 576 TB/s over 72 GPUs)",
        fp4_tflops=10000.0,
        memory_tbps=8.0,
    ),
    DevicePeak(
        "B200",
        2250.0,
        4500.0,
        "NVIDIA HGX B200 datasheet (36 PF bf16 / 72 PF fp8 / 144 PF fp4 sparse and 64 TB/s over 8 GPUs)",
        fp4_tflops=9000.0,
        memory_tbps=8.0,
    ),
    DevicePeak(
        "A100", 312.0, None, "NVIDIA A100 datasheet (no FP8 tensor cores; 80GB SXM: 2.039 TB/s)", memory_tbps=2.039
    ),
    DevicePeak(
        "GH200",
        989.4,
        1978.9,
        "NVIDIA GH200 Grace Hopper datasheet (the H100 SXM's tensor cores; 96 GB HBM3: 4 TB/s, 144 GB HBM3e: 4.9 TB/s)",
        memory_tbps=4.0,
    ),
    DevicePeak(
        "L40S", 362.05, 733.0, "NVIDIA L40S datasheet (733 bf16 / 1466 fp8 with sparsity; 864 GB/s)", memory_tbps=0.864
    ),
    DevicePeak(
        "L40", 181.05, 362.1, "NVIDIA L40 datasheet (362 bf16 / 724 fp8 with sparsity; 864 GB/s)", memory_tbps=0.864
    ),
    DevicePeak("L4", 121.0, 242.5, "NVIDIA L4 datasheet (242 bf16 / 485 fp8 with sparsity; 300 GB/s)", memory_tbps=0.3),
    DevicePeak(
        "RTX 4090",
        165.2,
        330.3,
        "NVIDIA Ada Lovelace architecture whitepaper (FP32 accumulate; 1008 GB/s)",
        memory_tbps=1.008,
    ),
    DevicePeak("MI300X", 1307.4, 2614.9, "AMD Instinct MI300X datasheet (5.3 TB/s)", memory_tbps=5.3),
)


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower())


def gpu_peak(device_name: str) -> DevicePeak | None:
    """The table's row for a device name as torch reports it ("NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-80GB"): the first row whose words all are words of the name; or None."""
    words = set(_words(device_name))
    return next((peak for peak in GPU_PEAKS if set(_words(peak.name)) <= words), None)
