"""What ``Accelerator.prepare`` hands back for optimizers, schedulers and dataloaders.

The wrappers add the three things a plain script must not have to write: fp16 loss scaling
(with skipped steps on inf/nan), gradient accumulation (step only on sync micro-batches) and
moving batches to the device (with a distributed sampler when there are several processes).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

if TYPE_CHECKING:
    from lowbit.accelerator import Accelerator


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: move_to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(move_to_device(v, device) for v in batch)
    if hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device) for v in batch))
    return batch


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
    """Steps the LR schedule only when its optimizer really stepped (not on accumulation or
    skipped fp16 steps), so the schedule counts optimizer updates, as the user meant."""

    def __init__(self, scheduler, optimizers: list[PreparedOptimizer], accelerator: "Accelerator"):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self._accelerator = accelerator

    def step(self, *args, **kwargs):
        if not self._accelerator.sync_gradients:
            return None
        if any(opt.step_was_skipped for opt in self.optimizers):
            return None
        return self.scheduler.step(*args, **kwargs)

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


class PreparedDataLoader:
    """Iterates the user's DataLoader (resharded per rank when distributed), moving batches to
    the device. Calls ``sampler.set_epoch`` so each epoch shuffles differently but identically
    on every rank."""

    def __init__(self, dataloader: torch.utils.data.DataLoader, device: torch.device, world_size: int, rank: int):
        self.base = dataloader
        self.device = device
        self.epoch = 0
        self.dataloader = dataloader if world_size <= 1 else self._shard(dataloader, world_size, rank)

    @staticmethod
    def _shard(dataloader, world_size: int, rank: int):
        from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

        shuffle = isinstance(dataloader.sampler, RandomSampler)
        sampler = DistributedSampler(dataloader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, drop_last=dataloader.drop_last)
        return DataLoader(
            dataloader.dataset,
            batch_size=dataloader.batch_size,
            sampler=sampler,
            num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory,
            drop_last=dataloader.drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataloader)

    @property
    def dataset(self):
        return self.dataloader.dataset

    @property
    def batch_size(self):
        return self.dataloader.batch_size

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.dataloader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        for batch in self.dataloader:
            yield move_to_device(batch, self.device)
        self.epoch += 1
