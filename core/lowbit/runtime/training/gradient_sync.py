"""The training loop's sync facts the prepared objects read: whether this micro-batch syncs
gradients (one flag per run) and which prepared loaders this process is iterating; and
turning a model's gradient all-reduce off or on for a block (DDP, FSDP2).

Accelerate's ``GradientState`` (:mod:`lowbit.compat.state`) answers its questions from these.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the module stays torch-free to import
    import torch


@dataclass
class GradientSync:
    """Whether this micro-batch reduces gradients and lets the optimizers step; each run
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


def skip_gradient_sync(model: torch.nn.Module, stack: contextlib.ExitStack) -> None:
    """Turn off the gradient all-reduce of ``model`` until ``stack`` closes (DDP's ``no_sync``,
    FSDP2's ``set_requires_gradient_sync``; nothing on one process)."""
    if hasattr(model, "no_sync"):
        stack.enter_context(model.no_sync())
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        stack.callback(model.set_requires_gradient_sync, True)


def force_gradient_sync(model: torch.nn.Module, stack: contextlib.ExitStack) -> None:
    """Make the next backward of ``model`` reduce its gradients until ``stack`` closes. DDP decides
    at forward time whether a backward syncs, so its reducer is told now to expect every gradient
    (DDP has no public call for this); FSDP2 is asked to sync."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        before = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        stack.callback(lambda: setattr(model, "require_backward_grad_sync", before[0]))
        stack.callback(lambda: setattr(model, "require_forward_param_sync", before[1]))
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(True)
