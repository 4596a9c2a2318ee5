"""What ``Accelerator.prepare`` hands back for optimizers and schedulers.

The wrappers add what a plain script must not have to write: fp16 loss scaling (with skipped
steps on inf/nan), gradient accumulation (step only on sync micro-batches), and the learning
rate schedule stepped as Accelerate steps it. Dataloaders are in :mod:`lowbit.data_loader`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from lowbit.accelerator import Accelerator


class PreparedOptimizer(torch.optim.Optimizer):
    """Delegates to the real optimizer; steps only on sync micro-batches; unscales fp16 grads.

    Subclasses ``Optimizer`` (without running its ``__init__``) so that LR schedulers, which
    check ``isinstance(optimizer, Optimizer)``, accept it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: "Accelerator", after_step: Callable[[], None] | None = None):
        self.optimizer = optimizer
        self._accelerator = accelerator
        self._after_step = after_step
        self.step_was_skipped = False

    # Attributes an Optimizer is expected to have, read through to the real one.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __getstate__(self):
        return self.optimizer.__getstate__()

    def __getattr__(self, name):
        # Methods of the optimizer it wraps (train()/eval() of schedule-free optimizers, ...).
        if name.startswith("__") or name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._accelerator.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if not self._accelerator.sync_gradients:
            return None
        scaler = self._accelerator.scaler
        if scaler is None:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self.step_was_skipped = False
        else:
            scale_before = scaler.get_scale()
            result = scaler.step(self.optimizer, closure) if closure is not None else scaler.step(self.optimizer)
            scaler.update()
            # GradScaler lowers the scale exactly when it skipped the step for inf/nan grads.
            self.step_was_skipped = scaler.get_scale() < scale_before
        self._accelerator._unscaled.discard(id(self.optimizer))
        if not self.step_was_skipped and self._after_step is not None:
            self._after_step()
        return result


class PreparedScheduler:
    """Steps the LR schedule as Accelerate does, so a script gets the same learning rates.

    Not on accumulation micro-batches or skipped fp16 steps. On an optimizer step it advances
    ``num_processes`` times (unless ``split_batches``): a schedule written for one process counts
    batches of the whole dataset, and each step of N processes consumes N batches. With
    ``step_scheduler_with_optimizer=False`` every call steps once, as the user wrote it.
    """

    def __init__(self, scheduler, optimizers: list[PreparedOptimizer], accelerator: "Accelerator"):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self._accelerator = accelerator

    def step(self, *args, **kwargs):
        acc = self._accelerator
        if not acc.step_scheduler_with_optimizer:
            return self.scheduler.step(*args, **kwargs)
        if not acc.sync_gradients or any(opt.step_was_skipped for opt in self.optimizers):
            return None
        repeats = 1 if acc.split_batches else acc.num_processes
        for _ in range(repeats):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)
        return None

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def __getattr__(self, name):
        return getattr(self.scheduler, name)
