"""Accelerate's ``accelerate.inference`` path (pipeline-parallel inference with PiPPy), which lowbit
does not do (it trains): every name imports, and raises on use, saying what to use."""
from __future__ import annotations

from typing import Any

from lowbit.compat.accelerate_names import not_offered

# Every name of this module refuses when used (the names table in the docs says so).
REFUSES_EVERY_NAME = True


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(f"module 'lowbit.inference' has no attribute {name!r}")
    return not_offered(f"accelerate.inference.{name}", "runs pipeline-parallel inference (PiPPy), which lowbit does not do "
                       "(it trains)", "Accelerate's (`pip install accelerate`)", is_class=name[:1].isupper())
