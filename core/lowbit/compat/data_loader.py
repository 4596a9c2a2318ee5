"""Accelerate's ``accelerate.data_loader`` path: the data-loading building blocks
(:mod:`lowbit.runtime.training.loader_shards`), lowbit's prepared dataloader, which
``accelerator.prepare`` returns (each process reads its own share, and ``save_state`` records
where it is), and the two blocks that read Accelerate's ``PartialState``, defined here:
``DataLoaderDispatcher`` and ``prepare_data_loader``."""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from lowbit.runtime.training.data_loader import PreparedDataLoader
from lowbit.runtime.training.dispatch import dispatched
from lowbit.runtime.training.loader_shards import (
    BatchSamplerShard,
    DataLoaderShard,
    DataLoaderStateMixin,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    loader_args,
    natively_sharded,
    skip_first_batches,
)

from lowbit.compat.state import PartialState
from lowbit.compat.utils.random import synchronize_rng_states

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
    "synchronize_rng_states",
]


class DataLoaderDispatcher(DataLoaderShard):
    """Accelerate's loader for ``dispatch_batches=True``: the main process iterates it and every
    process gets its slice of each step's global batch (training/dispatch.py, the rule lowbit's
    prepared dataloader follows too). ``slice_fn`` cuts a process's slice (default: slice_tensors)."""

    def __init__(
        self, dataset: Any, split_batches: bool = False, skip_batches: int = 0, slice_fn: Any = None, **kwargs: Any
    ):
        super().__init__(dataset, skip_batches=skip_batches, **kwargs)
        self.split_batches, self.slice_fn = split_batches, slice_fn

    def __len__(self) -> int:
        batches = DataLoader.__len__(self)
        processes = PartialState().num_processes
        steps = (
            batches
            if self.split_batches
            else (batches // processes if self.drop_last else math.ceil(batches / processes))
        )
        return steps - self.skip_batches

    def __iter__(self) -> Iterator[Any]:

        state = PartialState()
        self.set_epoch(self.iteration)
        self.begin()
        if state.process_index == 0:
            source = DataLoader.__iter__(self)
        else:  # iterating a DataLoader draws its workers' seed: the others draw it too
            source = None
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        steps = dispatched(
            source,
            state.num_processes,
            state.process_index,
            self.device or state.device,
            split_batches=self.split_batches,
            drop_last=self.drop_last,
            slice_fn=self.slice_fn,
        )
        try:
            for index, step in enumerate(steps):
                self.end_of_dataloader = step.last
                if step.last:
                    self.remainder = step.global_size
                if index >= self.skip_batches:
                    yield step.batch
        finally:
            self.end()
        self.iteration += 1


def prepare_data_loader(
    dataloader: DataLoader,
    device: Any = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Any = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoaderShard:
    """This process's DataLoaderShard of ``dataloader``: its batches (BatchSamplerShard) or its
    samples of a stream (IterableDatasetShard), on ``device`` with ``put_on_device``. The number
    of processes and this one's index default to the job's. With ``dispatch_batches`` (the default
    for an iterable dataset put on the device) a DataLoaderDispatcher: the main process reads."""
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError(
            "prepare_data_loader(dispatch_batches=True) broadcasts each batch on the device, so it needs "
            "put_on_device=True."
        )
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    args = loader_args(dataloader)
    dataset = dataloader.dataset
    if dispatch_batches:
        sampler = dataloader.batch_sampler
        if use_seedable_sampler and sampler is not None and isinstance(sampler.sampler, RandomSampler):
            args["batch_sampler"] = BatchSampler(
                SeedableRandomSampler(dataset, data_seed=data_seed), sampler.batch_size, sampler.drop_last
            )
        return DataLoaderDispatcher(
            dataset,
            split_batches=split_batches,
            device=device,
            _non_blocking=non_blocking,
            slice_fn=slice_fn_for_dispatch,
            **args,
        )
    if isinstance(dataset, IterableDataset):
        if num_processes > 1 and natively_sharded(dataset, num_processes, split_batches):
            dataset = dataset.shard(num_shards=num_processes, index=process_index)
        elif num_processes > 1:
            dataset = IterableDatasetShard(
                dataset,
                batch_size=dataloader.batch_size or 1,
                drop_last=dataloader.drop_last,
                num_processes=num_processes,
                process_index=process_index,
                split_batches=split_batches,
            )
            if split_batches and dataloader.batch_size:
                args["batch_size"] = dataloader.batch_size // num_processes
    elif dataloader.batch_sampler is not None:
        sampler = dataloader.batch_sampler
        if use_seedable_sampler and isinstance(sampler.sampler, RandomSampler):
            sampler = BatchSampler(
                SeedableRandomSampler(dataset, data_seed=data_seed), sampler.batch_size, sampler.drop_last
            )
        if num_processes > 1:
            sampler = BatchSamplerShard(sampler, num_processes, process_index, split_batches, even_batches)
        args["batch_sampler"] = sampler
    return DataLoaderShard(dataset, device=device if put_on_device else None, _non_blocking=non_blocking, **args)
