"""The prepared dataloader: batches sharded across processes the way Accelerate shards them.

With N processes, the user's batch sampler is read in rounds of N batches and process p takes
the p-th batch of each round, so a batch is never split and ``gather`` of one step returns the
round's samples in dataset order. The last, incomplete round is filled up with samples from the
start of the epoch (``even_batches``, the default) so every process runs the same number of
steps; ``gather_for_metrics`` drops exactly those repeated samples again. With ``split_batches``
each batch is cut into N equal slices instead. Shuffling follows Accelerate too, so that a script
sees the same samples in the same order under both: the sampler gets a generator seeded from the
global torch RNG at prepare time, and at the start of each epoch every process takes the main
process's generator state (broadcast on the process group's device: NCCL takes no CPU tensor).
The batches are loaded by a DataLoader built once with the user's loading settings
(``num_workers``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``),
drawing from this process's share of the batch indices, as Accelerate's sharded loader does.
An iterable dataset (a stream) is read by the main process and dispatched (``dispatch_batches``,
training/dispatch.py), Accelerate's default for it; not dispatched, each process reads the stream
and keeps its share (``IterableDatasetShard``, or a Hugging Face stream's own shards).
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from lowbit.runtime.nests import leaves
from lowbit.runtime.training.dispatch import dispatched
from lowbit.runtime.training.gradient_sync import loader_ended, loader_started
from lowbit.runtime.training.loader_shards import (
    BatchSamplerShard,
    IterableDatasetShard,
    loading_settings,
    natively_sharded,
    workers_outlive_sigterm,
)
from lowbit.runtime.training.operations import broadcast, send_to_device


@dataclass
class LoaderOptions:
    """How prepared dataloaders split and move batches (Accelerate's DataLoaderConfiguration, as
    values): one record, from the front's arguments to each prepared loader."""

    split_batches: bool = False
    even_batches: bool = True
    non_blocking: bool = False  # batches copied without a host wait
    dispatch_batches: bool | None = None  # the main process reads and dispatches (None: for iterable datasets)
    use_seedable_sampler: bool = False  # each epoch's order drawn from seed + epoch
    data_seed: int | None = None


class PreparedDataLoader(DataLoader):
    """A torch ``DataLoader`` (as Accelerate's prepared loaders are: ``isinstance`` checks in
    scripts and libraries hold) that loads through the user's own loader, ``base``: DataLoader's
    own ``__init__`` is not run, its attributes (``sampler``, ``num_workers``, ...) are read off
    ``base``, and iterating is this class's own."""

    # What ties a loader to the run that prepared it (the preemption stop, whose callbacks may be
    # lambdas; the throughput meter; the Accelerator's gradient state): not pickled, so a prepared
    # loader pickles as Accelerate's do; a copy read back loads the same batches, tied to no run.
    RUN_HOOKS = ("at_iteration_start", "observe_batch", "gradient_state", "last_batch")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self.RUN_HOOKS:
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __init__(
        self,
        dataloader: DataLoader,
        device: torch.device,
        num_processes: int,
        process_index: int,
        gradient_state: Any = None,
        *,
        options: LoaderOptions | None = None,
        device_placement: bool = True,
        slice_fn: Callable[..., Any] | None = None,
    ) -> None:
        options = options or LoaderOptions()
        split_batches, even_batches, dispatch_batches = (
            options.split_batches,
            options.even_batches,
            options.dispatch_batches,
        )
        use_seedable_sampler, data_seed = options.use_seedable_sampler, options.data_seed
        self.base = dataloader
        self.gradient_state = (
            gradient_state  # shown as Accelerate's loaders show theirs; the runtime reads gradient_sync
        )
        self.device = device
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.device_placement = device_placement
        # Copies to the device overlap with compute where the loader pins its batches (or when asked).
        self.non_blocking = options.non_blocking or bool(getattr(dataloader, "pin_memory", False))
        self.skip_batches = 0
        # Where an iteration stands, read through the gradient state while this loader is the one iterated.
        self.end_of_dataloader = False
        self.remainder = -1
        # The last batch was padded, but how many of its samples are real is unknown here (a stream
        # each process reads in loader workers): gather_for_metrics says so instead of cutting.
        self.remainder_unknown = False
        # Told each batch and the seconds spent waiting for it (the run's throughput meter).
        self.observe_batch: Any = None
        # Called each time the loop asks for its next batch (its last body finished): the preemption stop.
        self.at_iteration_start: Callable[[], None] | None = None
        # The batch last handed out, as the loop got it: what a non-finite step's diagnosis replays.
        self.last_batch: Any = None
        # The shuffle RNG's state when this epoch's order was drawn ("start"; None between epochs),
        # one to draw the next epoch's order from ("resume", set by load_state mid-epoch), whether
        # the epoch's last batch was handed out ("ended": a save then belongs to the next epoch),
        # and the epoch. A dict, so a skip_first_batches view shares it with the loader it was made from.
        self._replay: dict[str, Any] = {"start": None, "resume": None, "ended": False, "epoch": 0}
        if split_batches and dataloader.batch_size and dataloader.batch_size % num_processes:
            raise ValueError(
                f"split_batches=True needs a batch size divisible by the {num_processes} processes, got "
                f"{dataloader.batch_size}."
            )
        # Accelerate's rule: an iterable dataset (a stream) is read by the main process and dispatched,
        # unless asked otherwise; dispatching needs the batches on the device.
        streamed = isinstance(dataloader.dataset, IterableDataset)
        dispatch = streamed if dispatch_batches is None else bool(dispatch_batches)
        if dispatch and dispatch_batches and not device_placement:
            raise ValueError(
                "dispatch_batches=True broadcasts each batch from the main process on the device, so it "
                "needs device_placement=True (or leave dispatch_batches unset)."
            )
        self.dispatching = num_processes > 1 and dispatch and device_placement
        self.slice_fn = slice_fn
        # use_seedable_sampler: each epoch's order is drawn from seed + epoch (the seed: data_seed, or
        # torch's initial seed now), so set_epoch(k) replays epoch k's order, as Accelerate's
        # SeedableRandomSampler does; otherwise the order goes on from the generator's state.
        inner = getattr(dataloader.batch_sampler, "sampler", None)
        seedable = use_seedable_sampler and isinstance(inner, RandomSampler)
        self.seed_per_epoch = (data_seed if data_seed is not None else torch.initial_seed()) if seedable else None
        if seedable and inner.generator is None:
            inner.generator = torch.Generator()
        self.generator = self._shuffle_generator() if self._sharded else None
        # Several processes: this process's share of each epoch's batches, loaded by a DataLoader
        # with the user's own loading settings (workers, pinning, prefetching), built once so that
        # persistent workers persist.
        workers_outlive_sigterm(dataloader)  # a preempted job's checkpoint must not wait on its loader's workers
        self._shard_batches = _ShardBatches()
        self._shard_loader = _loader_like(dataloader, self._shard_batches) if self._sharded else None
        if self._streamed:  # a stream read by every process, each keeping its share (dispatch_batches=False)
            self._shard_loader = _stream_shard(dataloader, num_processes, process_index, split_batches)

    def _shuffle_generator(self) -> torch.Generator | None:
        """The shuffling sampler's generator, created (seeded from the global RNG) when it has none."""
        inner = getattr(self.base.batch_sampler, "sampler", None)
        if not hasattr(inner, "generator"):
            return None
        if inner.generator is None:
            inner.generator = torch.Generator()
            inner.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        return inner.generator

    # ------------------------------------------------------------------ what a DataLoader offers

    @property
    def dataset(self) -> Any:
        return self.base.dataset

    @property
    def batch_size(self) -> int | None:
        return self.base.batch_size

    @property
    def total_batch_size(self) -> int:
        size = self.base.batch_size or 1
        return size if self.split_batches else size * self.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.base.dataset)

    @property
    def epoch(self) -> int:
        return self._replay["epoch"]

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._replay["epoch"] = value

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        batch_sampler = self.base.batch_sampler
        for target in {
            id(t): t for t in (self.base.sampler, batch_sampler, getattr(batch_sampler, "sampler", None))
        }.values():
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def __len__(self) -> int:
        if self.dispatching:  # steps: rounds of num_processes batches (one batch each with split_batches)
            batches = len(self.base)
            steps = (
                batches
                if self.split_batches
                else (batches // self.num_processes if self.base.drop_last else -(-batches // self.num_processes))
            )
            return max(steps - self.skip_batches, 0)
        if self._streamed:
            return max(len(self._shard_loader) - self.skip_batches, 0)
        if not self._sharded:
            return max(len(self.base) - self.skip_batches, 0)
        saved = self.generator.get_state() if self.generator is not None else None
        count = len(self.batch_indices())
        if saved is not None:  # counting must not move the shuffle on
            self.generator.set_state(saved)
        return max(count - self.skip_batches, 0)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def skipping(self, num_batches: int) -> "PreparedDataLoader":
        """A view of this loader whose iterations start ``num_batches`` batches in (for resuming)."""
        view = copy.copy(self)
        view.skip_batches = num_batches
        return view

    # ------------------------------------------------------------------ sharding

    @property
    def _sharded(self) -> bool:
        """Each process reads its own batches of a map-style dataset."""
        return (
            self.num_processes > 1
            and not self.dispatching
            and not isinstance(self.base.dataset, IterableDataset)
            and self.base.batch_sampler is not None
        )

    @property
    def _streamed(self) -> bool:
        """Each process reads the whole stream and keeps its share (an iterable dataset, not dispatched)."""
        return self.num_processes > 1 and not self.dispatching and isinstance(self.base.dataset, IterableDataset)

    def batch_indices(self) -> list[list[int]]:
        """This process's batches of dataset indices for the current epoch."""
        sampler = self.base.batch_sampler
        return list(
            BatchSamplerShard(sampler, self.num_processes, self.process_index, self.split_batches, self.even_batches)
        )

    # ------------------------------------------------------------------ resuming mid-epoch

    def epoch_order_state(self) -> torch.Tensor | None:
        """The shuffle RNG's state this epoch's order was drawn from, while an epoch is under way
        (saved by save_state, so that a resumed run draws the same order); None between epochs,
        and once the epoch's last batch was handed out (a resumed run starts the next epoch)."""
        return None if self._replay["ended"] else self._replay["start"]

    def epoch_to_resume(self) -> int:
        """The epoch a run resumed from a save made now starts in: this one, or the next once its
        last batch was handed out (a save at the end of the loop body of an epoch's last step)."""
        return self.epoch + 1 if self._replay["ended"] else self.epoch

    def replay_epoch_order(self, state: torch.Tensor | None) -> None:
        """Draw the next epoch's order from ``state`` (load_state, mid-epoch): with
        ``skip_first_batches`` the resumed epoch then goes on with the batches it would have had."""
        self._replay["resume"] = state

    def _order_rng(self) -> torch.Generator | None:
        """The generator this loader's shuffle draws from; None: torch's global RNG."""
        if self.generator is not None:
            return self.generator
        return getattr(getattr(self.base.batch_sampler, "sampler", None), "generator", None)

    def _iter_base(self, rng: torch.Generator | None, resume: torch.Tensor | None) -> Iterator[Any]:
        """``iter(self.base)``; when resuming, its order (and worker seed) drawn from ``resume``
        and the RNG put back after, so that everything else draws as at the checkpoint."""
        if resume is None:
            return iter(self.base)
        # The workers' base seed is drawn from the loader's generator, or torch's global RNG: when that
        # is not the order's (use_seedable_sampler), the resumed epoch drew it before the checkpoint.
        seed_rng = self.base.generator
        seed_before = _rng_state(seed_rng) if seed_rng is not rng else None
        now = _rng_state(rng)
        _set_rng_state(rng, resume)
        batches = iter(self.base)
        first = next(batches, _END)  # the sampler draws its order at the first batch
        _set_rng_state(rng, now)
        if seed_before is not None:
            _set_rng_state(seed_rng, seed_before)
        return iter(()) if first is _END else itertools.chain([first], batches)

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader, self.remainder = False, -1
        rng, resume = self._order_rng(), self._replay["resume"]
        if self.seed_per_epoch is not None:
            rng.manual_seed(self.seed_per_epoch + self.epoch)
        self._replay["resume"], self._replay["ended"] = None, False
        if self.dispatching:
            batches, remainder = self._dispatched(rng, resume)
        elif self._streamed:
            self._replay["start"] = resume if resume is not None else _rng_state(rng)
            batches = iter(self._shard_loader)
            for _ in range(self.skip_batches):
                next(batches, None)
            remainder = self._stream_shard_remainder
        elif self._sharded:
            if self.generator is not None:  # every process shuffles as the main one does
                if resume is not None:
                    self.generator.set_state(resume)
                self.generator.set_state(broadcast(self.generator.get_state()))
            self._replay["start"] = _rng_state(rng)
            self._shard_batches.source = self
            # Iterating draws the workers' base seed (from the loader's generator, or torch's global
            # RNG), as a DataLoader does once per epoch in Accelerate too; a resumed epoch drew it
            # before the checkpoint, so its draw is put back to keep dropout's RNG stream unchanged.
            seed_rng = self.base.generator
            before = _rng_state(seed_rng) if resume is not None else None
            batches = iter(self._shard_loader)
            if before is not None:
                _set_rng_state(seed_rng, before)
            # Padding to drop in gather_for_metrics: only the last round's, when it was filled up
            # (drop_last drops that round instead, so nothing gathered is padding).
            padded = self.even_batches and not self.base.drop_last
            left = self.total_dataset_length % self.total_batch_size if padded else -1
            remainder = lambda _last: left  # noqa: E731
        else:
            self._replay["start"] = resume if resume is not None else _rng_state(rng)
            batches = self._iter_base(rng, resume)
            for _ in range(self.skip_batches):
                next(batches, None)
            left = self._unsharded_remainder()
            remainder = _observed_size if left == -1 and self._stream_read_whole else (lambda _last: left)
        if not self.dispatching and not self._streamed:  # known from the start (as Accelerate reports it)
            self.remainder = remainder(None)
        loader_started(self)
        try:
            yield from self._with_end_marked(batches, remainder)
        finally:  # out of the loop (done or left): the loop around it, if any, is the active one again
            loader_ended(self)
            self.end_of_dataloader, self.remainder = False, -1
        self._replay["start"], self._replay["ended"] = None, False
        self.set_epoch(self.epoch + 1)

    @property
    def _stream_read_whole(self) -> bool:
        """One process reads a whole stream in batches of a fixed size: the last batch's own size
        is its real size, as Accelerate reports it for a stream (its dispatcher's observed size)."""
        return isinstance(self.base.dataset, IterableDataset) and not self.base.drop_last and bool(self.base.batch_size)

    def _stream_shard_remainder(self, _last: Any) -> int:
        """Each process reading the stream and keeping its share: the real samples of the last read,
        the rest of it repeating the stream's first samples (IterableDatasetShard); -1 when nothing
        was filled (drop_last, a stream sharded by its own ``shard``) or loader workers read the stream
        (the count stays in the workers: ``remainder_unknown``, said by gather_for_metrics)."""
        shard = self._shard_loader.dataset
        if self.base.drop_last or not isinstance(shard, IterableDatasetShard):
            return -1
        if shard.last_read is None:
            self.remainder_unknown = True
            return -1
        return shard.last_read

    def _unsharded_remainder(self) -> int:
        """The last batch's size when it is short (0 when the batches divide the dataset), as
        Accelerate reports it for a loader every process reads whole; -1 when it drops that batch
        or cannot tell (a stream, batches of no fixed size)."""
        if self.base.drop_last or self.base.batch_size is None or isinstance(self.base.dataset, IterableDataset):
            return -1
        try:
            return self.total_dataset_length % self.total_batch_size
        except TypeError:  # a dataset without a length
            return -1

    def _dispatched(
        self, rng: torch.Generator | None, resume: torch.Tensor | None
    ) -> tuple[Iterator[Any], Callable[[], int]]:
        """dispatch_batches: the main process reads (and resumes) the epoch's order, the others get
        their slices; the remainder is the last global batch's size, known when it was read."""
        self._replay["start"] = resume if resume is not None else _rng_state(rng)
        source: Iterator[Any] | None = None
        if self.process_index == 0:
            source = self._iter_base(rng, resume)
        elif resume is None:
            # Iterating a DataLoader draws its workers' seed: the other processes draw it too, as in
            # Accelerate (a resumed epoch drew it before the checkpoint).
            torch.empty((), dtype=torch.int64).random_(generator=self.base.generator)
        last_size = [-1]

        def slices() -> Iterator[Any]:
            steps = dispatched(
                source,
                self.num_processes,
                self.process_index,
                self.device,
                split_batches=self.split_batches,
                drop_last=self.base.drop_last,
                slice_fn=self.slice_fn,
            )
            for index, step in enumerate(steps):
                if step.last:
                    last_size[0] = step.global_size
                if index >= self.skip_batches:
                    yield step.batch

        return slices(), lambda _last: last_size[0]

    def _with_end_marked(self, batches: Iterator[Any], remainder: Callable[[Any], int]) -> Iterator[Any]:
        """Yield batches, telling the gradient state when the last one comes (one-batch lookahead)
        and how many of its samples are not padding (``remainder(last_batch)``, read then), and
        ``observe_batch`` each batch with the seconds spent waiting for data."""
        start = time.perf_counter()
        current = next(batches, _END)
        while current is not _END:
            following = next(batches, _END)
            if following is _END:
                self.end_of_dataloader, self.remainder = True, remainder(current)
                self._replay["ended"] = True
            waited = time.perf_counter() - start
            if self.observe_batch is not None and self.device_placement:  # counted in the pass that moves it
                seen: list[torch.Tensor] = []
                self.last_batch = send_to_device(current, self.device, self.non_blocking, seen=seen)
                self.observe_batch(current, waited, seen)
            else:
                if self.observe_batch is not None:
                    self.observe_batch(current, waited)
                self.last_batch = (
                    send_to_device(current, self.device, self.non_blocking) if self.device_placement else current
                )
            yield self.last_batch
            if self.at_iteration_start is not None:
                self.at_iteration_start()
            start = time.perf_counter()
            current = following


_END = object()


def _observed_size(batch: Any) -> int:
    """The batch's size: its first tensor's first dimension (-1 when it has none)."""
    first = next((t for t in leaves(batch) if isinstance(t, torch.Tensor) and t.ndim), None)
    return first.shape[0] if first is not None else -1


class _ShardBatches:
    """The batch sampler of a multi-process loader: the iterating PreparedDataLoader's batches of
    dataset indices for this epoch, drawn when the first batch is asked for (after the DataLoader
    drew its workers' seed, as Accelerate's sharded sampler is)."""

    source: PreparedDataLoader | None = None

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: nothing is drawn until the first batch is asked for.
        if self.source is not None:
            yield from self.source.batch_indices()[self.source.skip_batches :]

    def __len__(self) -> int:
        return len(self.source) if self.source is not None else 0


def _stream_shard(dataloader: DataLoader, num_processes: int, process_index: int, split_batches: bool) -> DataLoader:
    """A DataLoader over this process's share of ``dataloader``'s stream (IterableDatasetShard),
    loading as ``dataloader`` does."""
    batch_size = dataloader.batch_size or 1
    if natively_sharded(dataloader.dataset, num_processes, split_batches):
        shard = dataloader.dataset.shard(num_shards=num_processes, index=process_index)
    else:
        shard = IterableDatasetShard(
            dataloader.dataset,
            batch_size=batch_size,
            drop_last=dataloader.drop_last,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=split_batches,
        )
    return DataLoader(
        shard,
        batch_size=batch_size // num_processes if split_batches else batch_size,
        drop_last=dataloader.drop_last,
        **loading_settings(dataloader),
    )


def _loader_like(dataloader: DataLoader, batch_sampler: _ShardBatches) -> DataLoader:
    """A DataLoader over ``dataloader``'s dataset that loads as it does (its workers, pinning,
    prefetching, worker_init_fn, collate_fn) and draws its batches from ``batch_sampler``."""
    return DataLoader(dataloader.dataset, batch_sampler=batch_sampler, **loading_settings(dataloader))


def _rng_state(rng: torch.Generator | None) -> torch.Tensor:
    return rng.get_state() if rng is not None else torch.get_rng_state()


def _set_rng_state(rng: torch.Generator | None, state: torch.Tensor) -> None:
    if rng is not None:
        rng.set_state(state)
    else:
        torch.set_rng_state(state)
