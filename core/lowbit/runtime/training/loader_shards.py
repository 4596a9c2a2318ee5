"""Accelerate's data-loading building blocks, for scripts that shard data themselves.

``BatchSamplerShard`` is the one rule of who reads which batch (lowbit's prepared dataloader uses
it too): with N processes the batches are dealt out in rounds, process p taking the p-th batch
of each round; a last, incomplete round is filled up from the start of the epoch (``even_batches``)
so every process runs the same number of steps; with ``split_batches`` each batch is cut into N
slices instead. ``IterableDatasetShard`` does the same for a stream of samples.
``DataLoaderShard`` is a ``DataLoader`` that puts batches on a device and says when it yields its
last one; ``SkipDataLoader`` / ``skip_first_batches`` start an epoch some batches in.
Accelerate's ``prepare_data_loader`` and ``DataLoaderDispatcher`` build on these in
:mod:`lowbit.compat.data_loader` (they read the job's ranks from ``PartialState``).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from lowbit.kernel.errors import ConfigError

from lowbit.runtime.training.operations import send_to_device


def _fill(samples: list[int], epoch_order: list[int], length: int) -> list[int]:
    """``samples`` topped up to ``length`` with samples from the start of the epoch, cycling."""
    out = list(samples)
    while len(out) < length:
        out.extend(epoch_order[: length - len(out)])
    return out


class BatchSamplerShard:
    """Process ``process_index``'s batches of ``batch_sampler`` (any iterable of index lists; its
    ``batch_size`` and ``drop_last`` are read when it has them). Batches of varying size (no
    ``batch_size``) are dealt out whole; an incomplete last round is then filled with whole batches
    from the start of the epoch."""

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ):
        self.batch_sampler, self.num_processes, self.process_index = batch_sampler, num_processes, process_index
        self.split_batches, self.even_batches = split_batches, even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches and self.batch_size is None:
            raise ConfigError(
                "split_batches=True cuts every batch into one slice per process, so it needs batches of "
                "one size: this batch sampler has no batch_size. Use split_batches=False."
            )
        if split_batches and self.batch_size % num_processes:
            raise ConfigError(
                f"split_batches=True needs a batch size that is a round multiple of the {num_processes} "
                f"processes, got {self.batch_size}."
            )

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        for target in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def __len__(self) -> int:
        batches, n = len(self.batch_sampler), self.num_processes
        if self.split_batches:
            return batches
        if self.drop_last:
            return batches // n
        if self.even_batches:
            return math.ceil(batches / n)
        return batches // n + (1 if self.process_index < batches % n else 0)

    def __iter__(self) -> Iterator[list[int]]:
        batches = [list(b) for b in self.batch_sampler]
        yield from self._split(batches) if self.split_batches else self._deal(batches)

    def _split(self, batches: list[list[int]]) -> Iterator[list[int]]:
        size, share = self.batch_size, self.batch_size // self.num_processes
        mine = slice(share * self.process_index, share * (self.process_index + 1))
        for index, batch in enumerate(batches):
            if len(batch) < size and index == len(batches) - 1 and self.even_batches:
                batch = _fill(batch, [i for b in batches for i in b], size)
            if batch[mine]:
                yield batch[mine]

    def _deal(self, batches: list[list[int]]) -> Iterator[list[int]]:
        n, size = self.num_processes, self.batch_size
        rounds = len(batches) // n
        if size is not None and rounds and len(batches[rounds * n - 1]) < size:
            rounds -= 1  # a short last batch does not complete a round
        yield from (batches[r * n + self.process_index] for r in range(rounds))
        leftover = batches[rounds * n :]
        if not leftover or self.drop_last:
            return
        if not self.even_batches:
            if self.process_index < len(leftover):
                yield leftover[self.process_index]
        elif size is None:  # whole batches from the start of the epoch complete the round
            yield (leftover + [batches[i % len(batches)] for i in range(n - len(leftover))])[self.process_index]
        else:  # samples from the start of the epoch complete the round
            last_round = _fill([i for b in leftover for i in b], [i for b in batches for i in b], size * n)
            yield last_round[size * self.process_index : size * (self.process_index + 1)]


class IterableDatasetShard(IterableDataset):
    """Process ``process_index``'s samples of a stream: read ``batch_size`` samples per process at a
    time (``batch_size`` in all with ``split_batches``) and keep this process's share; an
    incomplete last read is filled from the stream's first samples unless ``drop_last``."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ):
        if split_batches and batch_size > 1 and batch_size % num_processes:
            raise ConfigError(
                f"split_batches=True needs a batch size that is a round multiple of the {num_processes} "
                f"processes, got {batch_size}."
            )
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.num_processes, self.process_index, self.split_batches = num_processes, process_index, split_batches
        # The samples of the stream in the epoch's last read, once it was read (the rest of that
        # read repeats the stream's first samples): what gather_for_metrics keeps of the last
        # gathered batch. None until an epoch ended here (or when loader workers read the stream).
        self.last_read: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _sizes(self) -> tuple[int, int]:
        read = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        return read, (self.batch_size // self.num_processes if self.split_batches else self.batch_size)

    def __len__(self) -> int:
        read, share = self._sizes()
        rounds = len(self.dataset) // read if self.drop_last else math.ceil(len(self.dataset) / read)
        return rounds * share

    def __iter__(self) -> Iterator[Any]:
        read, share = self._sizes()
        mine = slice(share * self.process_index, share * (self.process_index + 1))
        first: list[Any] | None = None
        buffer: list[Any] = []
        self.last_read = None
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) == read:
                self.last_read = read
                yield from buffer[mine]
                first = first or buffer
                buffer = []
        if buffer and not self.drop_last:
            self.last_read = len(buffer)
            yield from _fill(buffer, first or buffer, read)[mine]


class SkipBatchSampler(BatchSampler):
    """``batch_sampler``'s batches after the first ``skip_batches``."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0):
        self.batch_sampler, self.skip_batches = batch_sampler, skip_batches

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.skip_batches


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order is a function of its seed and epoch: every process (and every
    resumed run) that sets the same epoch draws the same order."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any):
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class DataLoaderStateMixin:
    """``end_of_dataloader`` (the batch just yielded is the epoch's last) and ``remainder`` (samples
    of the last batch that are not padding; -1 when unknown), kept while a loader is iterated."""

    end_of_dataloader = False
    remainder = -1

    def begin(self) -> None:
        """An iteration starts: this loader is the active one (gradient_sync) until it ends."""
        from lowbit.runtime.training.gradient_sync import loader_started

        self.end_of_dataloader, self.remainder = False, -1
        loader_started(self)

    def end(self) -> None:
        from lowbit.runtime.training.gradient_sync import loader_ended

        self.end_of_dataloader = False
        loader_ended(self)


class DataLoaderShard(DataLoaderStateMixin, DataLoader):
    """A DataLoader (same arguments) that puts each batch on ``device``, skips the first
    ``skip_batches`` batches of an epoch, says when it yields its last batch, and passes
    ``set_epoch`` on to its sampler and dataset. ``base_dataloader`` is the plain DataLoader."""

    def __init__(
        self,
        dataset: Any,
        device: Any = None,
        rng_types: Any = None,
        synchronized_generator: Any = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        **kwargs: Any,
    ):
        if use_stateful_dataloader:
            raise ConfigError(
                "use_stateful_dataloader=True (torchdata's StatefulDataLoader) is not offered by lowbit: "
                "save_state records where each prepared dataloader is, and load_state resumes there."
            )
        super().__init__(dataset, **kwargs)
        self.device, self.skip_batches, self.non_blocking = device, skip_batches, _non_blocking
        self.iteration = 0
        self.__dict__["base_dataloader"] = DataLoader(dataset, **kwargs)

    @property
    def total_batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        for target in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None), self.sampler, self.dataset):
            if hasattr(target, "set_epoch") and target is not self:
                target.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        self.set_epoch(self.iteration)
        self.begin()
        batches = super().__iter__()
        current = next(batches, _END)
        index = 0
        try:
            while current is not _END:
                following = next(batches, _END)
                self.end_of_dataloader = following is _END
                if index >= self.skip_batches:
                    yield (
                        send_to_device(current, self.device, self.non_blocking) if self.device is not None else current
                    )
                current, index = following, index + 1
        finally:
            self.end()
        self.iteration += 1

    def __len__(self) -> int:
        return super().__len__() - self.skip_batches


class SkipDataLoader(DataLoaderShard):
    """A DataLoader over ``dataset`` whose epochs start ``skip_batches`` batches in."""


_END = object()
# How a DataLoader loads, not what: its workers, pinning, prefetching, collation and seeding.
LOADING_SETTINGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "in_order",
)


class WorkerInitIgnoringSigterm:
    """A DataLoader worker's init: a SIGTERM from anyone but its own main process is ignored, then
    the user's own ``worker_init_fn`` runs.

    A scheduler's SIGTERM (SLURM, Kubernetes, ``lowbit launch``) reaches the whole process group: a
    worker it killed ended the main process's epoch with "DataLoader worker is killed by signal"
    before the preemption checkpoint could be written. The main process stops its workers itself
    (torch's shutdown, or multiprocessing's at exit, sends them SIGTERM: that one still ends them,
    as torch's own worker handler does), and a worker exits when its main process dies (torch's
    watchdog), so none outlives the job. The sender is known from ``sigwaitinfo`` (Linux); where
    that is missing, torch's behaviour is kept."""

    def __init__(self, user_init: Any = None):
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        import signal

        if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
            import os
            import threading

            main_process = os.getppid()
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the thread below only

            def on_sigterm() -> None:
                while True:
                    if signal.sigwaitinfo({signal.SIGTERM}).si_pid == main_process:
                        os._exit(0)

            threading.Thread(target=on_sigterm, name="lowbit-sigterm", daemon=True).start()
        if self.user_init is not None:
            self.user_init(worker_id)


def workers_outlive_sigterm(dataloader: DataLoader) -> None:
    """Give ``dataloader``'s workers :class:`WorkerInitIgnoringSigterm` (once)."""
    if dataloader.num_workers > 0 and not isinstance(dataloader.worker_init_fn, WorkerInitIgnoringSigterm):
        dataloader.worker_init_fn = WorkerInitIgnoringSigterm(dataloader.worker_init_fn)


def loading_settings(dataloader: DataLoader) -> dict[str, Any]:
    """``dataloader``'s LOADING_SETTINGS, as DataLoader takes them (the worker ones only with workers)."""
    settings = {name: getattr(dataloader, name) for name in LOADING_SETTINGS if hasattr(dataloader, name)}
    if dataloader.num_workers == 0:
        settings.pop("prefetch_factor", None)
        settings.pop("persistent_workers", None)
    return settings


def loader_args(dataloader: DataLoader) -> dict[str, Any]:
    """The arguments ``dataloader`` was made with, as DataLoader takes them (batch_sampler or not)."""
    args = {
        "batch_size": dataloader.batch_size,
        "sampler": dataloader.sampler,
        "batch_sampler": dataloader.batch_sampler,
        "drop_last": dataloader.drop_last,
        **loading_settings(dataloader),
    }
    if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_sampler is None:
        args.pop("batch_sampler", None)
        args.pop("sampler", None)
    else:
        for name in ("batch_size", "sampler", "drop_last"):
            args.pop(name, None)
    return args


def natively_sharded(dataset: Any, num_processes: int, split_batches: bool) -> bool:
    """Whether a Hugging Face ``datasets`` stream splits into its own shards, one set per process
    (it has at least ``num_processes`` shards): each process then reads only its shards, instead of
    the whole stream keeping every N-th batch (IterableDatasetShard), as Accelerate does."""
    return (
        not split_batches
        and type(dataset).__module__.split(".")[0] == "datasets"
        and getattr(dataset, "n_shards", 0) >= num_processes
        and callable(getattr(dataset, "shard", None))
    )


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """``dataloader``, starting ``num_batches`` batches into its epoch (to resume): a prepared
    loader's view, or a DataLoaderShard/SkipDataLoader over the same data and order."""
    if hasattr(dataloader, "skipping"):  # lowbit's prepared dataloader
        return dataloader.skipping(num_batches)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches takes a DataLoader, got {type(dataloader).__name__}.")
    args = loader_args(dataloader)
    if isinstance(dataloader, DataLoaderShard):
        skipped = type(dataloader)(dataloader.dataset, device=dataloader.device, skip_batches=num_batches, **args)
        skipped.iteration = dataloader.iteration
        return skipped
    return SkipDataLoader(dataloader.dataset, skip_batches=num_batches, **args)
