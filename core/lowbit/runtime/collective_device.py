"""Where the tensors of lowbit's own collectives go, and NCCL's device rule held on a CPU.

A process group serves some device types: gloo serves the CPU (and CUDA), NCCL the GPU alone.
A collective on a tensor of a device type the group does not serve fails ("No backend type
associated with device type cpu"), so every collective lowbit issues itself (``gather``,
``reduce``, ``broadcast``, the step's finite-flag all-reduce, the preemption poll, the shuffle
order's broadcast) first hands its tensor to :func:`on_group_device`: under NCCL a CPU tensor is
copied to this process's GPU; the caller brings the result back where its own tensor was.
Which device a group needs is worked out once per process group, not per call.

**NCCL's rule on a CPU** (``LOWBIT_SIMULATE_NCCL=1``; ``lowbit launch --simulate_nccl``; the test
suite sets it for every multi-process run; a run over NCCL itself ignores it): on one machine type
every tensor sits on the same device, so a gloo run cannot show that a host tensor would reach NCCL.
Under the simulation the group refuses, as NCCL would, any tensor a lowbit module hands to a
collective without passing it through :func:`on_group_device` (which, having no GPU to copy to,
records the tensor as if it were on one), a tensor that is not contiguous or of a dtype NCCL has no
type for, and inputs whose shape or dtype differ between ranks (NCCL does not compare them: it hangs
or reads past the smaller buffer; the error names both). :func:`on_group_device` hands NCCL what it
takes: contiguous, int16 as int32. Collectives issued by torch itself (DDP, FSDP2, ``*_object``) and
by the user's own code are not checked: torch places theirs, and the user's are the user's.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable

import torch

from lowbit.kernel.env_numbers import SIMULATE_NCCL_ENV as SIMULATE_ENV
from lowbit.kernel.env_numbers import accelerate_flag, env_switch

# The collectives checked under the simulation, each with where its input tensor(s) sit in the
# call (position, keyword): what the tensor NCCL reads, as torch.distributed 2.11-2.13 names them.
CHECKED_COLLECTIVES = {
    "broadcast": (0, "tensor"),
    "all_reduce": (0, "tensor"),
    "reduce": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all_single": (1, "input"),
    "gather": (0, "tensor"),
    "scatter": (1, "scatter_list"),
    "send": (0, "tensor"),
    "isend": (0, "tensor"),
    "recv": (0, "tensor"),
    "irecv": (0, "tensor"),
}


# Whether collectives first compare their tensors' shapes across processes (one gather of Python
# objects per call: a debugging aid, off by default; ACCELERATE_DEBUG_MODE=1, or
# PartialState().debug = True). training/operations.py checks it.
SHAPE_CHECKS = {"on": accelerate_flag("ACCELERATE_DEBUG_MODE")}


# Collectives whose input NCCL takes to be the same shape and dtype on every rank without checking
# (gloo aborts on a mismatch; NCCL hangs or reads past the smaller buffer): compared under the simulation.
SAME_SHAPE_COLLECTIVES = frozenset(
    {"broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"}
)
# dtypes NCCL has no type for (c10d's NCCL type table, torch 2.11-2.13: int16 and the unsigned
# 16/32-bit types are missing; bool travels as uint8).
NCCL_REFUSED_DTYPES = frozenset({torch.int16, torch.uint16, torch.uint32})
# What on_group_device sends each as (wide enough for every value).
NCCL_WIRE_DTYPES = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


class NcclRuleError(RuntimeError):
    """A lowbit collective got a tensor NCCL would refuse (raised under the simulation only)."""


def asked_to_simulate() -> bool:
    return env_switch(SIMULATE_ENV, False)


# Whether this process holds its collectives to the simulated rule: asked to, over a group that
# serves the CPU (gloo). A run on GPUs, over NCCL itself, takes the real device hop instead.
_simulation = {"on": False}


# ---------------------------------------------------------------------- the device hop


_group_device: dict[str, Any] = {"group": None, "served": frozenset(), "accelerator": None}
# Tensors handed over by on_group_device under the simulation: "on the device" (by id; a tensor's
# == is elementwise, so no WeakSet).
_on_simulated_device: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _served_device_types() -> tuple[frozenset[str], torch.device | None]:
    """The device types the default group serves, and the device a tensor of any other type moves
    to (this process's current accelerator), worked out once per process group."""
    import torch.distributed as dist

    group = dist.GroupMember.WORLD
    if _group_device["group"] is not group:
        config = dist.get_backend_config()  # "cpu:gloo,cuda:gloo", "cuda:nccl", "cpu:gloo,cuda:nccl"
        served = frozenset(pair.split(":")[0] for pair in config.split(",") if ":" in pair)
        accelerator = None
        if "cpu" not in served and torch.accelerator.is_available():
            accelerator = torch.device(
                torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index()
            )
        _group_device.update(group=group, served=served, accelerator=accelerator)
    return _group_device["served"], _group_device["accelerator"]


def on_group_device(tensor: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``tensor`` where the process group can take it: as it is (or a copy, with ``copy``, for a
    collective that writes into it) when the group serves its device type, else copied to this
    process's accelerator; contiguous, and in a dtype NCCL has (int16 travels as int32, ...). The
    caller moves the result back (``.to(tensor.device, tensor.dtype)``: free when nothing moved)."""
    wire = NCCL_WIRE_DTYPES.get(tensor.dtype)
    if wire is not None or not tensor.is_contiguous():  # a new tensor: NCCL's dtype, one dense buffer
        tensor, copy = tensor.contiguous().to(wire or tensor.dtype), False
    if _simulation["on"]:
        out = tensor.clone() if copy else tensor
        _on_simulated_device[id(out)] = out
        return out
    served, accelerator = _served_device_types()
    if tensor.device.type in served or accelerator is None:
        return tensor.clone() if copy else tensor
    return tensor.to(accelerator)


# ---------------------------------------------------------------------- the simulated rule


def _caller_module(depth: int) -> str:
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _checked(name: str, collective: Callable[..., Any], position: int, keyword: str) -> Callable[..., Any]:
    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        caller = _caller_module(2)
        if caller.split(".")[0].startswith("lowbit"):
            given = args[position] if len(args) > position else kwargs.get(keyword)
            tensors = _tensors_in(given)
            for tensor in tensors:
                _check_one(name, caller, tensor)
            if name in SAME_SHAPE_COLLECTIVES and tensors:
                _check_same_shape_everywhere(name, caller, tensors[0])
        return collective(*args, **kwargs)

    call._lowbit_nccl_rule = True  # type: ignore[attr-defined]
    return call


def _check_one(name: str, caller: str, tensor: torch.Tensor) -> None:
    """One tensor against NCCL's rule: on the group's device, contiguous, a dtype NCCL has."""
    what = (
        f"{caller} called torch.distributed.{name} on a {tensor.device.type} tensor "
        f"({tuple(tensor.shape)}, {tensor.dtype})"
    )
    if _on_simulated_device.get(id(tensor)) is not tensor:
        raise NcclRuleError(
            f"{what} that was not put on the process group's device. NCCL takes tensors on this process's GPU only, so "
            f"this collective would fail on a GPU cluster ({SIMULATE_ENV}=1 holds CPU runs to that rule). Hand the "
            "tensor "
            "to lowbit.runtime.collective_device.on_group_device first and move the result back."
        )
    if not tensor.is_contiguous():
        raise NcclRuleError(
            f"{what} that is not contiguous: NCCL reads a tensor as one dense buffer and refuses it. "
            "Pass tensor.contiguous()."
        )
    if tensor.dtype in NCCL_REFUSED_DTYPES:
        raise NcclRuleError(
            f"{what}: NCCL has no {tensor.dtype} type and refuses it. Send it as int32/int64 (or "
            "uint8) and convert back."
        )


def _check_same_shape_everywhere(name: str, caller: str, tensor: torch.Tensor) -> None:
    """Every rank's input of the same shape and dtype (one object gather: the simulation only)."""
    import torch.distributed as dist

    mine = (tuple(tensor.shape), str(tensor.dtype))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    others = {rank: seen for rank, seen in enumerate(everyone) if seen != mine}
    if others:
        rank, (shape, dtype) = next(iter(others.items()))
        raise NcclRuleError(
            f"{caller} called torch.distributed.{name} with a tensor of shape {mine[0]} ({mine[1]}) on rank "
            f"{dist.get_rank()} and {shape} ({dtype}) on rank {rank}. NCCL does not compare them: it would hang or "
            "read "
            "past the smaller buffer (gloo aborts). Every rank must pass the same shape and dtype."
        )


def hold_to_nccl_rules() -> None:
    """Under ``LOWBIT_SIMULATE_NCCL=1`` and a process group that serves the CPU, make
    torch.distributed's collectives refuse what NCCL refuses from lowbit's modules (idempotent;
    nothing without the variable, nor over NCCL itself)."""
    if not asked_to_simulate():
        return
    import torch.distributed as dist

    if "cpu" not in _served_device_types()[0]:
        return
    _simulation["on"] = True

    for name, (position, keyword) in CHECKED_COLLECTIVES.items():
        collective = getattr(dist, name, None)
        if collective is not None and not getattr(collective, "_lowbit_nccl_rule", False):
            setattr(dist, name, _checked(name, collective, position, keyword))
