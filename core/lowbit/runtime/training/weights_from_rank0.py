"""Weights from rank 0: a big checkpoint read once, by rank 0, and sent to every other rank at
``prepare()`` (Accelerate's ``fsdp_cpu_ram_efficient_loading`` and ``fsdp_sync_module_states``).

Under ``lowbit launch`` with ``fsdp_cpu_ram_efficient_loading``, transformers' ``from_pretrained``
builds the model on the meta device on every rank but each machine's local rank 0 (it reads
``ACCELERATE_USE_FSDP`` and ``FSDP_CPU_RAM_EFFICIENT_LOADING``, which the launcher exports as
Accelerate's does); a script may build it under ``init_empty_weights`` itself. Two ways to fill:

- a strategy that shards (FSDP2): each tensor goes from rank 0 straight into every rank's shard,
  one tensor at a time (:func:`fill_shards`), so no rank but 0 ever holds the whole model;
- the others (DDP, ...): a rank whose weights are not loaded allocates them, and every parameter and
  buffer is broadcast from rank 0 (:func:`broadcast_whole`) before the backend converts the model.

Both collectives run once, at ``prepare()``, on the process group's device (NCCL's rule). Before
any tensor moves, the ranks compare what they hold (every tensor's name, shape and dtype) in one
small collective: models that differ are refused by name (broadcasts that stop pairing hang; on
NCCL a dtype mismatch would be silent corruption). A rank that allocates its weights ties again
what was tied (``to_empty`` gives each module a tensor of its own: a head tied to its embedding
would become two tensors, one broadcast more than rank 0 sends).
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch

from lowbit.kernel.errors import ConfigError

from lowbit.runtime.collective_device import on_group_device


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers (the non-persistent ones too: a rotary table built at init is one),
    each once, in the same order on every rank."""
    return itertools.chain(model.named_parameters(), model.named_buffers())


def unloaded_here(model: torch.nn.Module) -> bool:
    """Whether this rank holds weights that were never loaded (the meta device)."""
    return any(tensor.is_meta for _, tensor in _tensors(model))


def ranks_with_unloaded_weights(model: torch.nn.Module) -> tuple[bool, bool]:
    """(rank 0 has unloaded weights, any other rank has): one small all-reduce, at prepare()."""
    import torch.distributed as dist

    mine = unloaded_here(model)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine, False
    rank = dist.get_rank()
    flags = on_group_device(torch.tensor([int(mine and rank == 0), int(mine and rank != 0)]))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    on_zero, elsewhere = (bool(flag) for flag in flags.tolist())
    return on_zero, elsewhere


def refuse_unloaded_on_rank0() -> None:
    raise ConfigError(
        "The model's weights are on the meta device on rank 0 (built under init_empty_weights, or loaded with "
        "device_map='meta'): rank 0 is where every other rank takes them from. Load the checkpoint on rank 0."
    )


def _ties(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """The parameters several modules share (a head tied to its embedding): each as the
    (module, attribute) places that hold it."""
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module.named_parameters(recurse=False):
            places.setdefault(id(parameter), []).append((module, attribute))
    return [holders for holders in places.values() if len({id(m) for m, _ in holders}) > 1]


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate a model whose weights are not loaded here, on ``device``, tied as it was built."""
    ties = _ties(model)
    model.to_empty(device=device)
    for holders in ties:
        (first_module, first_attribute), *others = holders
        shared = getattr(first_module, first_attribute)
        for module, attribute in others:
            setattr(module, attribute, shared)


def _manifest(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in _tensors(model)]


def check_same_tensors(model: torch.nn.Module) -> None:
    """Every rank holds the same tensors (names, shapes, dtypes) as rank 0, or a ConfigError on every
    rank naming the first difference: one ``all_gather_object`` of the lists."""
    import torch.distributed as dist

    mine = _manifest(model)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    reference = every[0]
    for rank, theirs in enumerate(every[1:], start=1):
        if theirs == reference:
            continue
        ours = dict((n, (s, d)) for n, s, d in reference)
        other = dict((n, (s, d)) for n, s, d in theirs)
        difference = next(
            (
                f"{name}: {_shown(ours.get(name))} on rank 0, {_shown(other.get(name))} on rank {rank}"
                for name in [*ours, *other]
                if ours.get(name) != other.get(name)
            ),
            "the same tensors in another order",
        )
        raise ConfigError(
            f"prepare() fills every rank's weights from rank 0, and rank {rank}'s model is not rank 0's "
            f"({difference}). Build the same model, in the same dtype, on every rank (only rank 0 need load the "
            "checkpoint)."
        )


def _shown(entry: tuple[tuple[int, ...], str] | None) -> str:
    return "absent" if entry is None else f"{entry[1]} {list(entry[0])}"


def broadcast_whole(model: torch.nn.Module, device: torch.device) -> None:
    """Every rank ends with rank 0's parameters and buffers; a rank whose weights were not loaded
    allocates them on ``device`` first."""
    import torch.distributed as dist

    if unloaded_here(model):
        materialize(model, device)
    check_same_tensors(model)
    with torch.no_grad():
        for _, tensor in _tensors(model):
            wire = on_group_device(tensor, copy=True)
            dist.broadcast(wire, src=0)
            if wire is not tensor:
                tensor.copy_(wire.to(tensor.device, tensor.dtype))


def whole_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's tensors by name, taken before sharding (the references: nothing is copied)."""
    return {name: tensor.detach() for name, tensor in _tensors(model)}


def fill_shards(model: torch.nn.Module, whole: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """After sharding: every rank's shards and buffers take rank 0's values (``whole``, given on rank 0
    only). One tensor at a time goes out whole from rank 0; each rank keeps its part of it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    if unloaded_here(model):
        materialize(model, device)
    check_same_tensors(model)
    with torch.no_grad():
        for name, tensor in _tensors(model):
            is_sharded = isinstance(tensor, DTensor)
            shape, dtype = (tensor.shape, tensor.dtype)
            if whole is not None:
                full = whole[name].to(device=device, dtype=dtype)
            else:
                full = torch.empty(shape, dtype=dtype, device=device)
            wire = on_group_device(full, copy=False)
            dist.broadcast(wire, src=0)
            full = wire.to(device, dtype)
            if is_sharded:
                local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(local.to_local())
            else:
                tensor.copy_(full)
            del full, wire
