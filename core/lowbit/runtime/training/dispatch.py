"""``dispatch_batches``: the main process reads the batches and every process gets its slice.

Accelerate's default for an iterable dataset (a stream, whose samples only one reader can split
without reading them twice), and asked for with ``DataLoaderConfiguration(dispatch_batches=True)``.
Per step the main process reads N batches (one with ``split_batches``) and joins them into one
global batch; its layout (shapes, dtypes, and any non-tensor values) goes to the other processes
as an object, its tensors by broadcast (on the process group's device), and process p keeps the
p-th of N equal slices. A last global batch that does not split evenly is completed with the
first samples of the epoch's first global batch, and its size is the ``remainder`` that
``gather_for_metrics`` keeps. Without ``drop_last`` a last, incomplete round of batches is still
dispatched; with it, dropped. The same batches per process as Accelerate's DataLoaderDispatcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from lowbit.runtime.training.operations import broadcast, broadcast_object_list, recursively_apply


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """What a process needs to receive a tensor by broadcast: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class DispatchedBatch:
    """This process's slice of one global batch; ``global_size`` its number of samples, and whether
    it is the epoch's last."""

    batch: Any
    global_size: int
    last: bool


def _layout(batch: Any) -> Any:
    return recursively_apply(lambda t: TensorLayout(tuple(t.shape), t.dtype), batch)


def _allocate(layout: Any, device: torch.device) -> Any:
    return recursively_apply(
        lambda info: torch.empty(info.shape, dtype=info.dtype, device=device),
        layout,
        test_type=lambda leaf: isinstance(leaf, TensorLayout),
    )


def _batch_size(batch: Any) -> int:
    found: list[int] = []
    recursively_apply(lambda t: found.append(t.shape[0] if t.dim() else 1), batch)
    if not found:
        raise TypeError(
            "dispatch_batches=True needs batches that hold tensors (their first dimension is split over "
            f"the processes); got a {type(batch).__name__} with none."
        )
    return found[0]


def _per_sample(leaf: Any, size: int) -> bool:
    """A list of plain values, one per sample (names, ids, texts), which splits with the tensors."""
    return (
        isinstance(leaf, (list, tuple))
        and len(leaf) == size
        and not any(isinstance(item, (torch.Tensor, list, tuple, Mapping)) for item in leaf)
    )


def slice_samples(data: Any, part: slice, size: int) -> Any:
    """Samples ``part`` of a batch of ``size``: each tensor cut along its first dimension, each list
    of per-sample values (``_per_sample``) cut with them; any other value is the batch's, kept."""
    if isinstance(data, torch.Tensor):
        return data[part]
    if isinstance(data, Mapping):
        return type(data)({key: slice_samples(value, part, size) for key, value in data.items()})
    if _per_sample(data, size):
        return type(data)(data[part])
    if isinstance(data, (list, tuple)):
        return type(data)(slice_samples(item, part, size) for item in data)
    return data


def join_samples(parts: list[Any]) -> Any:
    """Batches joined into one: tensors concatenated, lists of per-sample values too; a value that
    is the batch's must be the same in each, or the batches do not join (an error names it)."""
    sizes = [_batch_size(part) for part in parts]

    def join(items: list[Any], where: str) -> Any:
        first = items[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(items, dim=0)
        if isinstance(first, Mapping):
            return type(first)({key: join([item[key] for item in items], f"{where}[{key!r}]") for key in first})
        if all(_per_sample(item, size) for item, size in zip(items, sizes)):
            return type(first)(value for item in items for value in item)
        if isinstance(first, (list, tuple)) and all(len(item) == len(first) for item in items):
            return type(first)(join([item[i] for item in items], f"{where}[{i}]") for i in range(len(first)))
        if any(item != first for item in items):
            raise TypeError(
                f"the batches hold {where or 'a value'} = {first!r} in one and {items[-1]!r} in another: "
                "neither a tensor nor one value per sample, so it cannot be joined or split"
            )
        return first

    return join(parts, "batch")


def global_batches(batches: Iterator[Any], num_processes: int, split_batches: bool, drop_last: bool) -> Iterator[Any]:
    """The main process's global batches: ``num_processes`` batches joined (one with ``split_batches``);
    a last, incomplete round is one more unless ``drop_last``."""
    wanted = 1 if split_batches else num_processes
    while True:
        parts = []
        for _ in range(wanted):
            batch = next(batches, _END)
            if batch is _END:
                break
            parts.append(batch)
        if not parts or (len(parts) < wanted and drop_last):
            return
        try:
            yield join_samples(parts)
        except (RuntimeError, TypeError) as exc:
            raise RuntimeError(
                f"dispatch_batches=True joins {wanted} batches into one per step, and these do not join ({exc}): "
                "batches "
                "of different shapes. Pad them to one shape in the collate_fn, use split_batches=True (the main "
                "process "
                "reads one batch and splits it), or dispatch_batches=False (each process reads its own batches)."
            ) from None
        if len(parts) < wanted:
            return


def dispatched(
    batches: Iterator[Any] | None,
    num_processes: int,
    process_index: int,
    device: torch.device,
    *,
    split_batches: bool,
    drop_last: bool,
    slice_fn: Callable[..., Any] | None = None,
) -> Iterator[DispatchedBatch]:
    """This process's slices of the global batches the main process reads from ``batches`` (None on
    the other processes). One object broadcast and one tensor broadcast per leaf per step; the main
    process reads one global batch ahead, so every process knows which one is the last."""
    main = process_index == 0
    source = global_batches(batches, num_processes, split_batches, drop_last) if main else None
    current = next(source, _END) if main else None
    first: Any = None
    while True:
        following = next(source, _END) if main and current is not _END else _END
        info = [_layout(current) if main and current is not _END else None, following is _END]
        broadcast_object_list(info)
        layout, last = info
        if layout is None:
            return
        batch = recursively_apply(lambda t: t.to(device), current) if main else _allocate(layout, device)
        batch = broadcast(batch)
        size = _batch_size(batch)
        if first is None and not drop_last:  # what completes a last batch that does not split evenly
            first = slice_samples(batch, slice(0, num_processes), size)
        share = size // num_processes
        if last and not drop_last and size % num_processes:
            batch, share = join_samples([batch, first]), share + 1
        mine = slice(process_index * share, (process_index + 1) * share)
        cut = (
            slice_fn(batch, mine, process_index=process_index, num_processes=num_processes)
            if slice_fn is not None
            else slice_samples(batch, mine, _batch_size(batch))
        )
        yield DispatchedBatch(cut, size, last)
        if last:
            return
        current = following


_END = object()
