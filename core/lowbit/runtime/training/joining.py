"""Uneven inputs under DDP (``join_uneven_inputs``): a rank that ran out of batches shadows the
collectives the others still run, through torch's ``Join``. DDP shadows its own (buffers,
gradients); lowbit's optimizer step has two of its own, which a joined rank shadows here: the
all-reduce by which every rank agrees that the step's loss and gradients were finite, and, every
``poll_every_steps`` steps, the preemption poll. Without them the other ranks would wait forever."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook


class OptimizerStepShadow(Joinable):
    """Joins lowbit's optimizer step: on a joined rank, each iteration the others train runs
    ``shadow_step`` (the step's collectives, with this rank's answers: finite, no signal), unless
    the DDP models listed before it found that the others run no backward (evaluation)."""

    def __init__(self, shadow_step: Callable[[], None], device: torch.device, models: list[Any]) -> None:
        super().__init__()
        self.shadow_step, self.device = shadow_step, device
        self.models = [m for m in models if isinstance(m, torch.nn.parallel.DistributedDataParallel)]

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ShadowStep(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD


class _ShadowStep(JoinHook):
    def __init__(self, joinable: OptimizerStepShadow) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        # DDP's own hook ran first (its model is listed first) and agreed with the others whether
        # they run backward this iteration: without backward there is no optimizer step to shadow.
        if all(model.require_forward_param_sync for model in self.joinable.models):
            self.joinable.shadow_step()
