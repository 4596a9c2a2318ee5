"""Collective operations on tensors and nested structures of them (dicts, lists, tuples).

Every function is a no-op copy on one process, so a script behaves the same with or without a
launcher. Used by the Accelerator's ``gather``/``reduce``/``pad_across_processes`` (and the run) and exported
from ``lowbit.compat.utils`` under Accelerate's names.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from lowbit.kernel import notices

from lowbit.runtime.collective_device import SHAPE_CHECKS, on_group_device
from lowbit.runtime.nests import leaves


class DistributedOperationException(Exception):
    """A collective the processes called with tensors that do not fit together (found under the
    shape checks: ``ACCELERATE_DEBUG_MODE=1``, or ``PartialState().debug = True``)."""


def _check_shapes_agree(
    operation: str, data: Any, describe: Callable[[torch.Tensor], Any] = lambda t: list(t.shape)
) -> None:
    """Under the shape checks, raise DistributedOperationException (on every process) when the
    processes' tensors differ in what ``describe`` says of them, naming each process's."""
    if not SHAPE_CHECKS["on"] or _world() == 1:
        return
    mine = recursively_apply(describe, data)
    everyone: list[Any] = [None] * _world()
    torch.distributed.all_gather_object(everyone, mine)
    if any(other != everyone[0] for other in everyone):
        listed = "\n".join(f"  process {rank}: {shapes}" for rank, shapes in enumerate(everyone))
        raise DistributedOperationException(
            f"{operation} was called with tensors that do not fit together across the processes, so it would hang or "
            f"mix up data. What each process passed:\n{listed}\nEvery process must pass the same structure with the "
            "same "
            "shapes (pad_across_processes evens out the first dimension before a gather)."
        )


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] | None = None,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func(leaf, *args, **kwargs)`` to every leaf that passes ``test_type`` (a tensor, by
    default) in a nest of dicts, lists, tuples and namedtuples; other leaves are kept, or refused
    with ``error_on_other_type``."""
    test = test_type or (lambda x: isinstance(x, torch.Tensor))

    def walk(item: Any) -> Any:
        if test(item):
            return func(item, *args, **kwargs)
        if isinstance(item, dict):
            return type(item)({k: walk(v) for k, v in item.items()})
        if isinstance(item, tuple) and hasattr(item, "_fields"):
            return type(item)(*(walk(v) for v in item))
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        if hasattr(item, "keys") and hasattr(item, "__getitem__"):  # transformers' ModelOutput / BatchEncoding
            return type(item)({k: walk(item[k]) for k in item.keys()})
        if error_on_other_type:
            raise TypeError(
                f"Unsupported type {type(item).__name__} passed to {getattr(func, '__name__', func)}: "
                "only nests of lists, tuples and dicts of tensors are supported."
            )
        return item

    return walk(data)


def listify(data: Any) -> Any:
    """Tensors in a nest turned into Python numbers and lists (for logging, JSON)."""
    return recursively_apply(lambda t: t.tolist(), data)


def _is_half_precision(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(data: Any) -> Any:
    """fp16 and bf16 tensors in a nest turned into fp32 (other tensors as they are). Every prepared
    forward returns through it: a bare tensor, the usual case, takes no walk."""
    if isinstance(data, torch.Tensor):
        return data.float() if _is_half_precision(data) else data
    return recursively_apply(torch.Tensor.float, data, test_type=_is_half_precision)


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """``model_forward`` with its fp16/bf16 outputs returned as fp32."""

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """A list of equally nested structures joined into one: their tensors concatenated along ``dim``.
    A list of one is returned as its item, whatever it holds."""
    if not data:
        raise ValueError("concatenate needs a non-empty list.")
    first = data[0]
    if len(data) == 1:
        return first
    if isinstance(first, (tuple, list)):
        return type(first)(concatenate([d[i] for d in data], dim=dim) for i in range(len(first)))
    if isinstance(first, dict):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first.keys()})
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"concatenate can only join tensors (or nests of them), got {type(first).__name__}.")
    return torch.cat(data, dim=dim)


def send_to_device(
    data: Any, device: torch.device | str, non_blocking: bool = False, seen: list[torch.Tensor] | None = None
) -> Any:
    """Every tensor of a nest on ``device``; ``seen`` gets each tensor as it passes (one walk for a
    caller that also looks at them: the throughput meter counts a batch in this pass)."""
    if seen is None:
        return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)
    return recursively_apply(lambda t: seen.append(t) or t.to(device, non_blocking=non_blocking), data)


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    sent = on_group_device(tensor.reshape(1) if tensor.dim() == 0 else tensor)
    parts = [torch.empty_like(sent) for _ in range(_world())]
    torch.distributed.all_gather(parts, sent)
    return torch.cat(parts, dim=0).to(tensor.device, tensor.dtype)


def gather(data: Any) -> Any:
    """Concatenate each tensor from every process along dim 0 (scalars become 1-D).

    Tensors must have the same shape on every process; use ``pad_across_processes`` first
    when their first dimension differs."""
    if _world() == 1:
        return data
    _check_shapes_agree("gather", data)
    return recursively_apply(_gather_one, data)


def gather_object(obj: Any) -> list[Any]:
    """A list of every process's picklable ``obj`` (lists are concatenated, as Accelerate does)."""
    if _world() == 1:
        return obj if isinstance(obj, list) else [obj]
    gathered: list[Any] = [None] * _world()
    torch.distributed.all_gather_object(gathered, obj)
    if all(isinstance(part, list) for part in gathered):
        return [item for part in gathered for item in part]
    return gathered


def gather_for_metrics(data: Any, use_gather_object: bool, loader: Any) -> Any:
    """``gather``, minus the samples repeated to even out the last batch of ``loader`` (the loop's
    prepared dataloader, or None) across processes, so a metric over the gathered predictions
    counts every sample once. Leaves that are not all tensors are gathered as objects."""
    use_gather_object = use_gather_object or not all(isinstance(t, torch.Tensor) for t in leaves(data))
    gathered = gather_object(data) if use_gather_object else gather(data)
    at_end = bool(getattr(loader, "end_of_dataloader", False))
    remainder = getattr(loader, "remainder", -1)
    if not at_end or remainder <= 0:
        if at_end and getattr(loader, "remainder_unknown", False):
            notices.warn(
                "gather_for_metrics: the last batch of this stream was filled up with the stream's first "
                "samples (each process reads the stream and keeps its share, dispatch_batches=False), and "
                "how many of its samples are real is not known here because loader workers read the stream "
                "(num_workers > 0): the gathered values include the repeated samples. Use num_workers=0, "
                "or leave dispatch_batches at its default (the main process reads the stream), or "
                "drop_last=True."
            )
        return gathered
    try:
        if use_gather_object:
            return gathered[:remainder]
        return recursively_apply(lambda t: t[:remainder], gathered)
    except (IndexError, TypeError):  # a leaf with no batch dimension (a 0-dim loss): all whole, as in Accelerate
        return gathered


REDUCTIONS = ("mean", "sum", "max", "none", None)


def _reduce_one(tensor: torch.Tensor, reduction: str, scale: float) -> torch.Tensor:
    if _world() > 1:
        out = on_group_device(tensor, copy=True)
        op = torch.distributed.ReduceOp.MAX if reduction == "max" else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(out, op=op)
        out = out.to(tensor.device, tensor.dtype)
    else:
        out = tensor.clone()
    if reduction == "mean":
        out = out / _world()
    return out * scale if scale != 1.0 else out


def reduce(data: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Average (the default, as Accelerate's function), sum or take the largest of each tensor over
    processes (``reduction``: "mean", "sum", "max"; "none" returns ``data``). Only tensors may be
    in the nest. ``Accelerator.reduce`` sums by default, as Accelerate's method does."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(repr(r) for r in REDUCTIONS)}, got {reduction!r}.")
    if reduction in ("none", None):
        return data
    _check_shapes_agree("reduce", data)
    return recursively_apply(lambda t: _reduce_one(t, reduction, scale), data, error_on_other_type=True)


class CannotPadNestedTensorWarning(UserWarning):
    """pad_across_processes met a nested tensor (its rows have their own lengths): returned as it is."""


def _pad_one(tensor: torch.Tensor, dim: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    if tensor.is_nested:
        warnings.warn(
            "pad_across_processes leaves a nested tensor as it is: its rows have lengths of their own, "
            "so there is no one size to pad to. Pad its rows before nesting them.",
            CannotPadNestedTensorWarning,
        )
        return tensor
    if not -tensor.dim() <= dim < tensor.dim() or _world() == 1:
        return tensor
    dim = dim % tensor.dim()
    size = torch.tensor([tensor.shape[dim]], device=tensor.device)
    sizes = _gather_one(size)
    longest = int(sizes.max())
    if longest == tensor.shape[dim]:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = longest
    out = (
        tensor.new_full(shape, pad_index)
        if not isinstance(pad_index, torch.Tensor)
        else tensor.new_zeros(shape) + pad_index
    )
    length = tensor.shape[dim]
    index = [slice(None)] * tensor.dim()
    index[dim] = slice(longest - length, longest) if pad_first else slice(0, length)
    out[tuple(index)] = tensor
    return out


def pad_across_processes(data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the longest size on any process, so it can be gathered."""
    # The processes' tensors may differ in the padded dimension, not in their number of dimensions.
    _check_shapes_agree("pad_across_processes", data, describe=lambda t: t.dim())
    return recursively_apply(lambda t: _pad_one(t, dim, pad_index, pad_first), data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Every process gets ``from_process``'s tensors (same shapes everywhere)."""
    if _world() == 1:
        return data
    _check_shapes_agree("broadcast", data)

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = on_group_device(tensor, copy=True)
        torch.distributed.broadcast(out, src=from_process)
        return out.to(tensor.device, tensor.dtype)

    return recursively_apply(one, data)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The main process's ``tensor`` on every process (the others pass None), on the same type of
    device as the main process's."""
    if _world() == 1:
        return tensor
    rank = torch.distributed.get_rank()
    layout = [(tuple(tensor.shape), tensor.dtype, tensor.device.type) if rank == 0 else None]
    torch.distributed.broadcast_object_list(layout, src=0)
    shape, dtype, device_type = layout[0]
    if rank != 0:
        device = torch.device(device_type, torch.accelerator.current_device_index()) if device_type != "cpu" else "cpu"
        tensor = torch.empty(shape, dtype=dtype, device=device)
    return broadcast(tensor)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    if _world() > 1:
        torch.distributed.broadcast_object_list(object_list, src=from_process)
    return object_list


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor in a nest (dicts in key order, lists in order), or None."""
    if isinstance(data, torch.Tensor):
        return data.device
    items = data.values() if isinstance(data, dict) else data if isinstance(data, (list, tuple)) else ()
    return next((device for device in map(find_device, items) if device is not None), None)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is a namedtuple (a tuple subclass with ``_fields``)."""
    return isinstance(data, tuple) and isinstance(getattr(data, "_fields", None), tuple)


def pad_input_tensors(data: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Each tensor in a nest grown with zero rows along ``dim`` from ``batch_size`` to the next
    multiple of ``num_processes``, so the batch splits evenly (the caller drops the padding after)."""
    target = -(-batch_size // num_processes) * num_processes

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        if target == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = target - tensor.shape[dim]
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)

    return recursively_apply(pad, data, error_on_other_type=True)


def slice_tensors(
    data: Any, tensor_slice: Any, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """Every tensor of a nest cut with ``tensor_slice`` (a slice, or anything a tensor indexes with)."""
    return recursively_apply(lambda tensor: tensor[tensor_slice], data)
