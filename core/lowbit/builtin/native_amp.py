"""Built-in precision plugin "native": torch's native autocast for fp16 and bf16, and the outer
bf16 context that FP8 backends run inside. What each precision means (the autocast, built once at
``prepare()``; fp16's loss scaling) is answered by :class:`lowbit.training.precision.Precision`."""
from __future__ import annotations

from lowbit.hookspecs import hookimpl
from lowbit.types import HardwareInfo, PrecisionDescription

NAME = "native"


@hookimpl
def describe_backend(hardware: HardwareInfo) -> PrecisionDescription:
    return PrecisionDescription(name=NAME, priority=0, available=True, aliases=("amp", "torch"))
