"""Collective operations on tensors and nested structures of them (dicts, lists, tuples).

Every function is a no-op copy on one process, so a script behaves the same with or without a
launcher. Used by the Accelerator's ``gather``/``reduce``/``pad_across_processes`` and exported
from ``lowbit.utils`` under Accelerate's names.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def recursively_apply(func: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply ``func`` to every tensor in a nest of dicts, lists, tuples and namedtuples."""
    if isinstance(data, torch.Tensor):
        return func(data)
    if isinstance(data, dict):
        return type(data)({k: recursively_apply(func, v) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(recursively_apply(func, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(func, v) for v in data)
    if hasattr(data, "keys") and hasattr(data, "__getitem__"):  # transformers' ModelOutput / BatchEncoding
        return type(data)({k: recursively_apply(func, data[k]) for k in data.keys()})
    return data


def send_to_device(data: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_world())]
    torch.distributed.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def gather(data: Any) -> Any:
    """Concatenate each tensor from every process along dim 0 (scalars become 1-D).

    Tensors must have the same shape on every process; use ``pad_across_processes`` first
    when their first dimension differs."""
    if _world() == 1:
        return data
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


def _reduce_one(tensor: torch.Tensor, reduction: str, scale: float) -> torch.Tensor:
    out = tensor.clone()
    if _world() > 1:
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
    if reduction == "mean":
        out = out / _world()
    return out * scale if scale != 1.0 else out


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sum (or average, with ``reduction="mean"``) each tensor over processes."""
    if reduction not in ("sum", "mean", "none", None):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}.")
    if reduction in ("none", None):
        return data
    return recursively_apply(lambda t: _reduce_one(t, reduction, scale), data)


def _pad_one(tensor: torch.Tensor, dim: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    if tensor.dim() == 0 or dim >= tensor.dim() or _world() == 1:
        return tensor
    size = torch.tensor([tensor.shape[dim]], device=tensor.device)
    sizes = _gather_one(size)
    longest = int(sizes.max())
    if longest == tensor.shape[dim]:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = longest
    out = tensor.new_full(shape, pad_index) if not isinstance(pad_index, torch.Tensor) else tensor.new_zeros(shape) + pad_index
    length = tensor.shape[dim]
    index = [slice(None)] * tensor.dim()
    index[dim] = slice(longest - length, longest) if pad_first else slice(0, length)
    out[tuple(index)] = tensor
    return out


def pad_across_processes(data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the longest size on any process, so it can be gathered."""
    return recursively_apply(lambda t: _pad_one(t, dim, pad_index, pad_first), data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Every process gets ``from_process``'s tensors (same shapes everywhere)."""
    if _world() == 1:
        return data

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.contiguous().clone()
        torch.distributed.broadcast(out, src=from_process)
        return out

    return recursively_apply(one, data)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    if _world() > 1:
        torch.distributed.broadcast_object_list(object_list, src=from_process)
    return object_list

