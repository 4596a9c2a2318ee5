"""Accelerate's ``accelerate.hooks`` path. Its hooks move weights between devices and disk around
each forward for big-model inference, which lowbit does not do (it trains): every name imports,
so a script's imports keep working, and raises on use, saying what to use.
"""
from __future__ import annotations

from typing import Any

from lowbit.compat.accelerate_names import INFERENCE_USE, not_offered

# Every name of this module refuses when used (the names table in the docs says so).
REFUSES_EVERY_NAME = True

WHY = ("moves weights between devices and disk around each forward for big-model inference, which lowbit does not "
       "do (it trains)")


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(f"module 'lowbit.hooks' has no attribute {name!r}")
    return not_offered(f"accelerate.hooks.{name}", WHY, INFERENCE_USE, is_class=name[:1].isupper())
