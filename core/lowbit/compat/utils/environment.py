"""Accelerate's ``accelerate.utils.environment`` path: changing environment variables for a block,
a function or a test class, and restoring them after."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import unittest
from typing import Any, Iterator

from lowbit.compat.paths import public_path

__all__ = ["clear_environment", "convert_dict_to_env_variables", "patch_environment", "purge_accelerate_environment"]


def __getattr__(name: str) -> Any:
    if name == "override_numa_affinity":
        from lowbit.compat.utils.refused import refused

        return refused(name)
    raise AttributeError(f"module 'lowbit.utils.environment' has no attribute {name!r}")


logger = logging.getLogger(public_path(__name__))
# The variables the launchers set for their processes (lowbit reads both families).
_LAUNCHER_PREFIXES = ("ACCELERATE_", "LOWBIT_")


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables for the block (names upper-cased, values as text); those
    variables' previous values (or their absence) come back after it, also when it raises. Other
    variables the block sets are left as they are, as Accelerate's does."""
    patched = {key.upper(): str(value) for key, value in kwargs.items()}
    before = {key: os.environ.get(key) for key in patched}
    os.environ.update(patched)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """An empty environment for the block; every variable comes back after it."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _launcher_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_LAUNCHER_PREFIXES)}


@contextlib.contextmanager
def _without_launcher_variables() -> Iterator[None]:
    saved = _launcher_variables()
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        for key in _launcher_variables():
            del os.environ[key]
        os.environ.update(saved)


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Run a function, or each test of a class (unittest or pytest style, subclasses included),
    without the ACCELERATE_* and LOWBIT_* variables a launcher or an earlier test left behind;
    the variables as they were come back after each call."""
    if not isinstance(func_or_cls, type):

        @functools.wraps(func_or_cls)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _without_launcher_variables():
                return func_or_cls(*args, **kwargs)

        return wrapper
    cls = func_or_cls
    setup_name, teardown_name = (
        ("setUp", "tearDown") if issubclass(cls, unittest.TestCase) else ("setup_method", "teardown_method")
    )
    setup, teardown = getattr(cls, setup_name, None), getattr(cls, teardown_name, None)

    def purged_setup(self: Any, *args: Any) -> None:
        self._lowbit_purge = _without_launcher_variables()
        self._lowbit_purge.__enter__()
        if setup is not None:
            setup(self, *args)

    def purged_teardown(self: Any, *args: Any) -> None:
        try:
            if teardown is not None:
                teardown(self, *args)
        finally:
            self._lowbit_purge.__exit__(None, None, None)

    setattr(cls, setup_name, purged_setup)
    setattr(cls, teardown_name, purged_teardown)
    return cls


# A variable name a shell accepts, and a value with no character the shell would read as syntax.
_VALID_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SHELL_SYNTAX = re.compile(r"[<>|;&`$\\\n]")


def convert_dict_to_env_variables(current_env: dict[str, Any]) -> list[str]:
    """``["NAME=value\\n", ...]`` for an environment file; a name or value a shell would misread is
    left out with a warning."""
    lines = []
    for name, value in current_env.items():
        if _VALID_NAME.match(name) and not _SHELL_SYNTAX.search(str(value)):
            lines.append(f"{name}={value}\n")
        else:
            logger.warning(
                "%s=%r is left out of the environment file: a shell would not read it back as it is.", name, value
            )
    return lines
