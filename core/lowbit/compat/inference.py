"""Accelerate's ``accelerate.inference`` path (pipeline-parallel inference with PiPPy), which lowbit
does not do (it trains): every name imports, and raises on use, saying what to use."""

from __future__ import annotations

from lowbit.compat.accelerate_names import refusing_module

# Every name of this module refuses when used (the names table in the docs says so).
REFUSES_EVERY_NAME = True


__getattr__ = refusing_module(
    __name__,
    (
        "runs pipeline-parallel inference (PiPPy), which lowbit does not do (it trains)",
        "Accelerate's (`pip install accelerate`)",
    ),
)
