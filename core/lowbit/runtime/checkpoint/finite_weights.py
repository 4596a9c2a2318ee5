"""A save never writes NaN/inf weights unseen: ``save_state`` and ``save_model`` check first
(parameters, and floating buffers such as BatchNorm's running statistics).

A run whose weights went NaN (a step taken with ``on_nonfinite_loss="continue"``, a corrupted
load) would otherwise overwrite its last good checkpoint with one it cannot train from. The check
reads every parameter once per save (each rank its own shard), and the ranks agree, so a NaN on
one rank's shard stops the save on all. ``allow_nonfinite=True`` writes them anyway.
"""

from __future__ import annotations

from typing import Iterable

import torch

from lowbit.kernel.errors import CheckpointError

from lowbit.runtime.collective_device import on_group_device
from lowbit.runtime.finite import nonfinite

SHOWN = 5


def refuse_nonfinite_weights(models: Iterable[torch.nn.Module], what: str, num_processes: int) -> None:
    """Raise naming the parameters that hold NaN/inf (on this rank, or the count on others)."""
    bad = []
    for index, model in enumerate(models):
        for name, param in model.named_parameters():
            if nonfinite(param):
                bad.append(f"{name}" if index == 0 else f"model {index}: {name}")
        # Floating buffers too: a NaN batch folds into BatchNorm's running stats in the forward,
        # before any check, and every eval after it is NaN.
        for name in nonfinite_buffers(model):
            bad.append(f"{name} (buffer)" if index == 0 else f"model {index}: {name} (buffer)")
    count = len(bad)
    if num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        total = on_group_device(torch.tensor([count]))
        torch.distributed.all_reduce(total)
        count = int(total.item())
    if count:
        named = (
            f": {', '.join(bad[:SHOWN])}{' and more' if len(bad) > SHOWN else ''}"
            if bad
            else " (on another rank's shard)"
        )
        raise CheckpointError(
            f"{what}: {count} weight tensor(s) hold NaN or inf{named}. Nothing was written, so the last checkpoint "
            f"stays the one to resume from. To write them anyway (to inspect them), pass allow_nonfinite=True."
        )


def nonfinite_buffers(model: torch.nn.Module) -> list[str]:
    """The model's floating buffers that hold NaN or inf, by name."""
    return [name for name, buffer in model.named_buffers() if nonfinite(buffer)]
