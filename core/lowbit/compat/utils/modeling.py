"""Accelerate's ``accelerate.utils.modeling`` path: the model-inspection and weight-loading helpers
(sizes, tied weights, moving one tensor, loading saved weights). Placing a model over devices and
disk for inference is not lowbit's job: those names import and raise on use, saying what to use.
``has_offloaded_params`` answers for a model placed that way by Accelerate or transformers."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from lowbit.compat.accelerate_names import INFERENCE_USE, INFERENCE_WHY, not_offered, refusing_module

__all__ = [
    "align_module_device",
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "get_max_layer_size",
    "get_module_children_bottom_up",
    "has_offloaded_params",
    "has_transformer_engine_layers",
    "load_checkpoint_in_model",
    "load_state_dict",
    "merge_fsdp_weights",
    "retie_parameters",
    "set_module_tensor_to_device",
]


def has_offloaded_params(module: Any) -> bool:
    """Whether ``module``'s weights live elsewhere between forwards (an offloading hook); importing
    this path loads no torch, so the answer is looked up when asked."""
    from lowbit.runtime.checkpoint import model_files

    return model_files.has_offloaded_params(module)


def _bytes(tensor: Any, dtype: Any = None) -> int:
    import torch

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    size = torch.finfo(dtype).bits // 8 if dtype is not None and tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * size


def compute_module_sizes(
    model: Any, dtype: Any = None, special_dtypes: dict[str, Any] | None = None, buffers_only: bool = False
) -> dict[str, int]:
    """Bytes of every module and of the whole model (key ``""``): its parameters and buffers (only
    buffers with ``buffers_only``), counted in ``dtype`` (floating tensors) or a tensor's own entry of
    ``special_dtypes``."""
    from collections import defaultdict

    sizes: dict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tensors:
        size = _bytes(tensor, (special_dtypes or {}).get(name, dtype))
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return dict(sizes)


def get_max_layer_size(
    modules: list[tuple[str, Any]], module_sizes: dict[str, int], no_split_module_classes: list[str]
) -> tuple[int, list[str]]:
    """The largest layer among ``modules`` and the names of the layers of that size; a layer is a
    module with no children or one of ``no_split_module_classes`` (others are looked into)."""
    largest, names = 0, []
    queue = list(modules)
    while queue:
        name, module = queue.pop(0)
        children = list(module.named_children())
        if children and type(module).__name__ not in no_split_module_classes:
            queue = [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in children] + queue
            continue
        size = module_sizes.get(name, 0)
        if size > largest:
            largest, names = size, [name]
        elif size == largest:
            names.append(name)
    return largest, names


def calculate_maximum_sizes(model: Any) -> tuple[int, tuple[int, list[str]]]:
    """The model's bytes, and its largest layer's (transformers' ``_no_split_modules`` kept whole)."""
    sizes = compute_module_sizes(model)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    return sizes[""], get_max_layer_size(list(model.named_children()), sizes, no_split)


def get_module_children_bottom_up(model: Any, return_fqns: bool = False) -> list[Any]:
    """Every module of ``model``, children before their parents (the model last); with
    ``return_fqns``, as ``(qualified name, module)`` pairs."""
    ordered = list(model.named_modules())[::-1]
    return ordered if return_fqns else [module for _, module in ordered]


def retie_parameters(model: Any, tied_params: list[list[str]]) -> None:
    """Tie again each group of parameter names to its first one's tensor (a tie lost on the way)."""
    for group in tied_params:
        owner, _, name = group[0].rpartition(".")
        shared = getattr(model.get_submodule(owner), name)
        for other in group[1:]:
            module_name, _, param_name = other.rpartition(".")
            setattr(model.get_submodule(module_name), param_name, shared)


def set_module_tensor_to_device(
    module: Any,
    tensor_name: str,
    device: Any,
    value: Any = None,
    dtype: Any = None,
    fp16_statistics: Any = None,
    tied_params_map: Any = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer ``tensor_name`` (dotted) of ``module`` on ``device``, replaced by
    ``value`` when given (cast to ``dtype``, else to the old tensor's floating dtype), keeping it a
    Parameter (with its ``requires_grad``) if it was one."""
    import torch

    owner_name, _, name = tensor_name.rpartition(".")
    owner = module.get_submodule(owner_name)
    old = getattr(owner, name)
    new = old if value is None else torch.as_tensor(value)
    if value is not None and (dtype is not None or old.is_floating_point()):
        new = new.to(dtype or old.dtype)
    new = new.to(device, non_blocking=non_blocking)
    # setattr keeps a parameter registered as one, and a buffer as a buffer (persistent or not)
    setattr(
        owner,
        name,
        torch.nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else new,
    )


def load_state_dict(checkpoint_file: str | os.PathLike, device_map: Any = None) -> dict[str, Any]:
    """The tensors of one weights file (safetensors, or a pickled file read with ``weights_only``)."""
    from lowbit.runtime.checkpoint.model_files import read_model_files

    if device_map is not None:
        not_offered("load_state_dict(device_map=...)", INFERENCE_WHY, INFERENCE_USE)()  # raises
    return read_model_files(checkpoint_file)


def has_transformer_engine_layers(model: Any) -> bool:
    """Whether ``model`` holds Transformer Engine layers (as lowbit-te converts them)."""
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


@contextlib.contextmanager
def align_module_device(module: Any, execution_device: Any = None) -> Iterator[None]:
    """Within the block, ``module``'s parameters are on ``execution_device`` (then moved back);
    without one, nothing moves. A module whose weights an offloading hook holds is refused."""
    if has_offloaded_params(module):
        not_offered("align_module_device on an offloaded module", INFERENCE_WHY, INFERENCE_USE)()  # raises
    if execution_device is None:
        yield
        return
    homes = {name: p.device for name, p in module.named_parameters(recurse=False)}
    for name in homes:
        set_module_tensor_to_device(module, name, execution_device)
    try:
        yield
    finally:
        for name, device in homes.items():
            set_module_tensor_to_device(module, name, device)


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike,
    output_path: str | os.PathLike,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> None:
    """The weights of a sharded (torch.distributed.checkpoint) FSDP save, written whole into
    ``output_path`` as save_model writes them (one process, no process group needed)."""
    import shutil
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lowbit.runtime.checkpoint.model_files import write_model_files

    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(checkpoint_dir, whole)
        state = torch.load(whole, weights_only=True)
    if set(state) == {"model"} and isinstance(state["model"], dict):  # saved as {"model": state_dict}
        state = state["model"]
    write_model_files(state, output_path, safe_serialization=safe_serialization)
    if remove_checkpoint_dir:
        shutil.rmtree(checkpoint_dir)


def load_checkpoint_in_model(
    model: Any,
    checkpoint: str | os.PathLike,
    device_map: Any = None,
    offload_folder: Any = None,
    dtype: Any = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load the weights ``save_model`` wrote (one file, a directory, or shards with their index) into
    ``model``, cast to ``dtype`` when given (modules named in ``keep_in_fp32_modules`` stay fp32).
    Placing the model over devices and disk (``device_map``, offloading) is inference dispatch,
    which lowbit does not do: those arguments raise, saying what to use."""
    import torch

    from lowbit.runtime.checkpoint.model_files import read_model_files

    placing = {
        "device_map": device_map,
        "offload_folder": offload_folder,
        "offload_state_dict": offload_state_dict,
        "offload_buffers": offload_buffers,
        "offload_8bit_bnb": offload_8bit_bnb,
    }
    asked = [name for name, value in placing.items() if value]
    if asked:
        not_offered(f"load_checkpoint_in_model({asked[0]}=...)", INFERENCE_WHY, INFERENCE_USE)()  # raises
    state = read_model_files(checkpoint)
    if dtype is not None:
        keep = tuple(keep_in_fp32_modules or ())
        state = {
            key: value.to(torch.float32 if any(part in key.split(".") for part in keep) else dtype)
            if torch.is_tensor(value) and value.is_floating_point()
            else value
            for key, value in state.items()
        }
    model.load_state_dict(state, strict=strict)


__getattr__ = refusing_module(__name__, (INFERENCE_WHY, INFERENCE_USE))
