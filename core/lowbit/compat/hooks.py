"""Accelerate's ``accelerate.hooks`` path. Its hooks move weights between devices and disk around
each forward for big-model inference, which lowbit does not do (it trains): every name imports,
so a script's imports keep working, and raises on use, saying what to use.
"""

from __future__ import annotations

from lowbit.compat.accelerate_names import INFERENCE_USE, refusing_module

# Every name of this module refuses when used (the names table in the docs says so).
REFUSES_EVERY_NAME = True

WHY = (
    "moves weights between devices and disk around each forward for big-model inference, which lowbit does not "
    "do (it trains)"
)


__getattr__ = refusing_module(__name__, (WHY, INFERENCE_USE))
