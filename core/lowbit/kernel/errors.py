"""Exceptions raised by lowbit, and the "did you mean" helper they share.

Every error is written for a person: what was wrong, what was expected, what to do.
"""

from __future__ import annotations

import difflib
from typing import Iterable


class LowbitError(Exception):
    """Base class of every error lowbit raises on purpose."""


class ConfigError(LowbitError, ValueError):
    """A setting (argument, env var, YAML key or CLI flag) has a bad name or value."""


class PluginError(LowbitError):
    """A plugin could not be loaded, or broke the hook contract (strict mode only)."""


class BackendNotFoundError(LowbitError, ValueError):
    """A backend name that no installed plugin provides."""


class BackendUnavailableError(LowbitError, RuntimeError):
    """A backend that is installed but cannot run here (missing library, wrong hardware)."""


class UnsupportedCombinationError(LowbitError, RuntimeError):
    """Two choices that cannot work together, e.g. MS-AMP under ZeRO-3. Raised at prepare()."""


class CheckpointError(LowbitError, RuntimeError):
    """A checkpoint that is missing, truncated, corrupted, or written by another setup."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ' Did you mean 'x'?' for the closest valid choice, or '' when nothing is close."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.5)
    if not close:
        lowered = {c.lower(): c for c in choices}
        close = difflib.get_close_matches(str(name).lower(), list(lowered), n=1, cutoff=0.5)
        close = [lowered[c] for c in close]
    return f" Did you mean {close[0]!r}?" if close else ""


def unknown_choice(what: str, name: object, choices: Iterable[str]) -> str:
    """Message for a name outside a closed set: names it, lists the valid ones, suggests one."""
    choices = sorted(set(choices))
    return f"Unknown {what} {name!r}.{did_you_mean(str(name), choices)} Valid: {', '.join(choices)}."


# The attribute a stand-in for a name lowbit does not offer carries: why (the docs' names table reads it).
NOT_OFFERED_MARK = "__lowbit_not_offered__"
