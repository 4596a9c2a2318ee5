"""Accelerate's ``accelerate.utils.imports`` path: ``is_<library>_available()``."""
from lowbit.utils import AVAILABILITY_CHECKS, availability_check


def __getattr__(name: str):
    if name in AVAILABILITY_CHECKS:
        return availability_check(name)
    raise AttributeError(f"module 'lowbit.utils.imports' has no attribute {name!r}")
