"""One voice for everything lowbit tells a user outside an error: ``lowbit: note: ...`` (for
information) or ``lowbit: warning: ...`` (something to act on), one line, once per process
group (the main rank), never followed by a line of lowbit's own source.

Each is still a real ``warnings`` category, so users filter them as usual
(``warnings.filterwarnings("ignore", category=lowbit.kernel.notices.LowbitNote)``, ``-W``, pytest's
``filterwarnings``); only their printed form is lowbit's. Plugins use :func:`note` and
:func:`warn` too, and may subclass the two categories (``EmulationNotice(LowbitNote)``).
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from typing import Any


class LowbitNote(UserWarning):
    """Information: what lowbit chose or did for you (emulation, sizing, a setting it ignores)."""


class LowbitWarning(UserWarning):
    """Something to act on: numerics in trouble, a setting that may not do what you meant."""


# What a parent process (``lowbit launch``) already said, so that its ranks do not say it again.
SAID_ENV = "LOWBIT_SAID_NOTES"
_said: set[str] = set(filter(None, os.environ.get(SAID_ENV, "").split(",")))


def _key(category: type[Warning], message: str) -> str:
    return hashlib.sha1(f"{category.__name__}:{message}".encode()).hexdigest()[:16]


def said_env() -> dict[str, str]:
    """The env entry that tells child processes which notices were said already."""
    return {SAID_ENV: ",".join(sorted(_said))} if _said else {}


def _main_rank() -> bool:
    """The main process of the group: torch.distributed's rank when it is up, else the launcher's RANK."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _say(message: str, category: type[Warning], stacklevel: int, every_rank: bool) -> None:
    if not every_rank and not _main_rank():
        return
    key = _key(category, message)
    if key in _said:  # the same notice twice in one process (two Accelerators, a re-read config) is said once
        return
    _said.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 2)


def note(message: str, category: type[LowbitNote] = LowbitNote, stacklevel: int = 1, every_rank: bool = False) -> None:
    """``lowbit: note: <message>`` once, on the main rank (``every_rank``: on each rank that meets it)."""
    _say(message, category, stacklevel, every_rank)


def warn(
    message: str, category: type[LowbitWarning] = LowbitWarning, stacklevel: int = 1, every_rank: bool = False
) -> None:
    """``lowbit: warning: <message>`` once, on the main rank (``every_rank``: on each rank that meets it)."""
    _say(message, category, stacklevel, every_rank)


def format_notice(message: Any, category: type[Warning]) -> str | None:
    """The printed line of a lowbit notice, or None for any other warning."""
    if issubclass(category, LowbitNote):
        return f"lowbit: note: {message}\n"
    if issubclass(category, LowbitWarning):
        return f"lowbit: warning: {message}\n"
    return None


_original_showwarning = warnings.showwarning


def _showwarning(message, category, filename, lineno, file=None, line=None):
    text = format_notice(message, category)
    if text is None:
        return _original_showwarning(message, category, filename, lineno, file, line)
    stream = file if file is not None else sys.stderr
    try:
        stream.write(text)
    except (OSError, AttributeError):  # a closed or missing stderr: as the warnings module does
        pass


def install() -> None:
    """Print lowbit's notices in its own one-line form (other warnings are untouched). Idempotent;
    runs when lowbit is imported. A ``showwarning`` someone installed later (pytest's recorder,
    ``logging.captureWarnings``) still sees every notice as a normal warning."""
    global _original_showwarning
    if warnings.showwarning is not _showwarning:
        _original_showwarning = warnings.showwarning
        warnings.showwarning = _showwarning


def reset() -> None:
    """Forget which notices were said (a test suite, or a notebook that wants them again)."""
    _said.clear()
