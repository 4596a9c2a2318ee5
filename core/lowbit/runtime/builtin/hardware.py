"""Built-in hardware detector: the current CUDA device when there is one, else the CPU."""

from __future__ import annotations

import os
import platform

from lowbit.kernel.hookspecs import hookimpl
from lowbit.kernel.types import HardwareInfo


@hookimpl(trylast=True)
def detect_hardware(cpu: bool) -> HardwareInfo:
    import torch

    if not cpu and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())) % torch.cuda.device_count()
        return HardwareInfo(
            device_type="cuda",
            device_name=torch.cuda.get_device_name(index),
            device_count=torch.cuda.device_count(),
            compute_capability=tuple(torch.cuda.get_device_capability(index)),
            cuda_version=_cuda_version(torch.version.cuda),
        )
    return HardwareInfo(device_type="cpu", device_name=platform.processor() or "CPU", device_count=os.cpu_count() or 1)


def _cuda_version(text: str | None) -> tuple[int, int] | None:
    """ "12.9" -> (12, 9); None for a build without CUDA."""
    if not text:
        return None
    major, _, minor = text.partition(".")
    return int(major), int(minor.split(".")[0] or 0)
