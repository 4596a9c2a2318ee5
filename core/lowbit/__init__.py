"""lowbit: FP8 / BF16 / FP16 training for plain PyTorch scripts.

    from lowbit import Accelerator
    accelerator = Accelerator(mixed_precision="fp8")

Public names are loaded lazily so that ``import lowbit`` (and ``lowbit --help``) stays free of
torch until something that needs it is touched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowbit.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["Accelerator", "hookimpl", "__version__"]

if TYPE_CHECKING:
    from lowbit.accelerator import Accelerator


def __getattr__(name: str) -> Any:
    if name == "Accelerator":
        from lowbit.accelerator import Accelerator

        return Accelerator
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
