"""Built-in precision plugin: torch's native autocast for fp16 and bf16, and the outer bf16
context that FP8 backends run inside. fp16 loss scaling lives in the Accelerator's optimizer
wrapper (``torch.amp.GradScaler``), because it spans backward and step, not forward."""
from __future__ import annotations

from typing import ContextManager

from lowbit.hookspecs import hookimpl
from lowbit.types import HardwareInfo, PrecisionDescription, PrepareContext

NAME = "native"


@hookimpl
def describe_backend(hardware: HardwareInfo) -> PrecisionDescription:
    return PrecisionDescription(name=NAME, priority=0, available=True, aliases=("amp", "torch"))


@hookimpl
def autocast_context(context: PrepareContext) -> ContextManager | None:
    dtype = context.autocast_dtype
    if dtype is None:
        return None
    import torch

    return torch.autocast(device_type=context.device.type, dtype=dtype)
