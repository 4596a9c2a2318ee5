"""BatchNorm's running statistics put back when an optimizer step is skipped for NaN/inf.

A forward folds its batch into BatchNorm's ``running_mean``/``running_var`` (and counts it in
``num_batches_tracked``) before any check can see the batch, so a NaN batch spoils them and every
eval after it is NaN, though the skipped step left the weights alone. They are small (two vectors
per layer): each step that goes through copies them into buffers kept aside (no allocation, no host
sync), and a skipped step copies them back, so the skipped step's micro-batches leave no trace.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm


class NormStatsKeeper:
    """The running statistics of the prepared models' BatchNorm layers as of the last step."""

    def __init__(self) -> None:
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live buffer, copy as of the last step)
        self._watched: set[int] = set()

    def watch(self, model: torch.nn.Module) -> None:
        """Keep ``model``'s BatchNorm statistics from now on (their values now: the first copy)."""
        for module in model.modules():
            if id(module) in self._watched:
                continue
            self._watched.add(id(module))
            if isinstance(module, _BatchNorm) and module.track_running_stats:
                for buffer in (module.running_mean, module.running_var, module.num_batches_tracked):
                    if buffer is not None:
                        self._kept.append((buffer, buffer.detach().clone()))

    def forget(self) -> None:
        """The models were released (``free_memory()``): keep nothing of theirs."""
        self._kept.clear()
        self._watched.clear()

    def keep(self) -> None:
        """After a step that went through: these statistics are the good ones."""
        with torch.no_grad():
            for live, copy in self._kept:
                copy.copy_(live)

    def restore(self) -> str | None:
        """A step was skipped: the statistics as they were after the last good step; what was done, said."""
        if not self._kept:
            return None
        with torch.no_grad():
            for live, copy in self._kept:
                live.copy_(copy)
        return "BatchNorm's running statistics are put back as they were after the last step"
