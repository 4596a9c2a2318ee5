"""Accelerate's ``accelerate.utils.fsdp_utils`` path: a sharded model's checkpoint files as
transformers' ``Trainer`` writes and reads them (under ``fsdp=``), in Accelerate's layout.

``state_dict_type`` "FULL_STATE_DICT": the full state gathered into the main process and written
as ``pytorch_model_fsdp.bin`` / ``optimizer.bin``; otherwise (sharded) a
``torch.distributed.checkpoint`` folder ``pytorch_model_fsdp_<i>`` / ``optimizer_<i>``, which loads
on another number of processes. Every process calls these, as in Accelerate.
"""

from __future__ import annotations

import os
from typing import Any

from lowbit.compat.utils.constants import FSDP_MODEL_NAME

__all__ = [
    "save_fsdp_model",
    "load_fsdp_model",
    "save_fsdp_optimizer",
    "load_fsdp_optimizer",
    "get_parameters_from_modules",
]

OPTIMIZER_NAME = "optimizer"


def _full(fsdp_plugin: Any) -> bool:
    return "FULL_STATE_DICT" in str(getattr(fsdp_plugin, "state_dict_type", None) or "")


def _name(base: str, index: int, full: bool) -> str:
    return f"{base}.bin" if full and index == 0 else f"{base}_{index}.bin" if full else f"{base}_{index}"


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # lowbit's prepared optimizer holds torch's


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    output_dir: str | os.PathLike,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lowbit.runtime.builtin.sharded_state import plain_weight

    os.makedirs(output_dir, exist_ok=True)
    if _full(fsdp_plugin):
        state = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            torch.save(state, os.path.join(output_dir, _name(FSDP_MODEL_NAME, model_index, True)))
    else:
        state = {name: plain_weight(value) for name, value in get_model_state_dict(model).items()}
        dcp.save({"model": state}, checkpoint_id=os.path.join(output_dir, _name(FSDP_MODEL_NAME, model_index, False)))
    accelerator.wait_for_everyone()


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    input_dir: str | os.PathLike,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> Any:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    accelerator.wait_for_everyone()
    full_file = os.path.join(input_dir, _name(FSDP_MODEL_NAME, model_index, True))
    if os.path.isfile(full_file):
        state = torch.load(full_file, map_location="cpu", weights_only=True)
        return set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=os.path.join(input_dir, _name(FSDP_MODEL_NAME, model_index, False)))
    return set_model_state_dict(model, state["model"])


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    output_dir: str | os.PathLike,
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    os.makedirs(output_dir, exist_ok=True)
    if _full(fsdp_plugin):
        state = get_optimizer_state_dict(
            model, _inner(optimizer), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if accelerator.is_main_process:
            torch.save(state, os.path.join(output_dir, _name(OPTIMIZER_NAME, optimizer_index, True)))
    else:
        state = get_optimizer_state_dict(model, _inner(optimizer))
        dcp.save(
            {"optimizer": state}, checkpoint_id=os.path.join(output_dir, _name(OPTIMIZER_NAME, optimizer_index, False))
        )
    accelerator.wait_for_everyone()


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    input_dir: str | os.PathLike,
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    accelerator.wait_for_everyone()
    inner = _inner(optimizer)
    full_file = os.path.join(input_dir, _name(OPTIMIZER_NAME, optimizer_index, True))
    if os.path.isfile(full_file):
        state = torch.load(full_file, map_location="cpu", weights_only=True)
        set_optimizer_state_dict(model, inner, state, options=StateDictOptions(full_state_dict=True))
        return
    state = {"optimizer": get_optimizer_state_dict(model, inner)}
    dcp.load(state, checkpoint_id=os.path.join(input_dir, _name(OPTIMIZER_NAME, optimizer_index, False)))
    set_optimizer_state_dict(model, inner, state["optimizer"])


def get_parameters_from_modules(modules: Any, model: Any, device: Any) -> set:
    """The parameters of ``modules``: a list of modules, or a regular expression matched against the
    whole of each module's name in ``model`` (those modules are moved to ``device``)."""
    import re

    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [module.to(device) for name, module in model.named_modules() if pattern.fullmatch(name)]
    return {parameter for module in modules for parameter in module.parameters()}
