"""The state of a model laid out over processes (FSDP2 shards, tensor-parallel DTensors): the full
state dict gathered into the main process, and training checkpoints through
``torch.distributed.checkpoint`` (DCP), which loads on another number of processes or mesh shape
(it reshards)."""

from __future__ import annotations

from typing import Any

# The checkpoint's folder inside a save_state directory (its name kept from when FSDP2 alone wrote it).
FOLDER = "fsdp_sharded"


def full_state_dict(model: Any) -> dict[str, Any]:
    """Gathered one parameter at a time into the main process's RAM only (cpu_offload): a model
    that needs sharding does not fit whole on each GPU. The other ranks take part and get {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(directory: str, model: Any, optimizer: Any) -> bool:
    """Write the checkpoint; True (a strategy's ``save_checkpoint`` answer: done)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, [optimizer] if optimizer is not None else [])
    model_state = {name: plain_weight(value) for name, value in model_state.items()}
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=f"{directory}/{FOLDER}")
    return True


def load(directory: str, model: Any, optimizer: Any) -> bool:
    """Read the checkpoint into the model and optimizer, resharded to this layout; True."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optimizers = [optimizer] if optimizer is not None else []
    model_state, optim_state = get_state_dict(model, optimizers)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=f"{directory}/{FOLDER}")
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return True


def plain_weight(value: Any) -> Any:
    """A weight a backend wraps in a tensor subclass holding one tensor of its shape (torchao's
    float8 all-gather weights) is saved as that tensor: the checkpoint then loads without the
    backend's classes, under another precision or backend too (DCP pickles a subclass's metadata)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    local = value.to_local() if isinstance(value, DTensor) else value
    if not is_traceable_wrapper_subclass(local):
        return value
    names = local.__tensor_flatten__()[0]
    inner = getattr(local, names[0]) if len(names) == 1 else None
    if not isinstance(inner, torch.Tensor) or inner.shape != local.shape:
        return value
    if isinstance(value, DTensor):
        return DTensor.from_local(
            inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    return inner
