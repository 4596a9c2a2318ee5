"""The training loop's sync facts the prepared objects read: whether this micro-batch syncs
gradients (one flag per Accelerator) and which prepared loaders this process is iterating.

Accelerate's ``GradientState`` (:mod:`lowbit.compat.state`) answers its questions from these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GradientSync:
    """Whether this micro-batch reduces gradients and lets the optimizers step; each Accelerator
    owns one (``accumulate`` and ``no_sync`` set it)."""

    sync_gradients: bool = True


# The prepared loaders being iterated in this process, innermost last. One stack per process, not
# per Accelerator: nested loops nest in the process, whichever Accelerator prepared each loader.
ITERATED_LOADERS: list[Any] = []


def loader_started(loader: Any) -> None:
    """``loader`` is iterated from now on (innermost)."""
    ITERATED_LOADERS.append(loader)


def loader_ended(loader: Any) -> None:
    """``loader``'s iteration ended (done, or left)."""
    for index in range(len(ITERATED_LOADERS) - 1, -1, -1):
        if ITERATED_LOADERS[index] is loader:
            del ITERATED_LOADERS[index]
            return


def active_loader() -> Any:
    """The loader being iterated (the innermost, when loops nest), or None."""
    return ITERATED_LOADERS[-1] if ITERATED_LOADERS else None
