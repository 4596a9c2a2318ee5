"""Accelerate's ``accelerate.utils.modeling`` path. Most of it places a model over devices and disk
for inference, which lowbit does not do: those names import and raise on use, saying what to use.
``has_offloaded_params`` answers for a model placed that way by Accelerate or transformers."""
from __future__ import annotations

import os
from typing import Any

from lowbit.compat.accelerate_names import INFERENCE_USE, INFERENCE_WHY, not_offered

__all__ = ["has_offloaded_params", "load_checkpoint_in_model"]


def has_offloaded_params(module: Any) -> bool:
    """Whether ``module`` carries an offloading hook (Accelerate's ``_hf_hook`` with ``offload``,
    as transformers' ``device_map`` loading leaves it): its weights live elsewhere between forwards."""
    return bool(getattr(getattr(module, "_hf_hook", None), "offload", False))


def load_checkpoint_in_model(model: Any, checkpoint: str | os.PathLike, device_map: Any = None, offload_folder: Any = None,
                             dtype: Any = None, offload_state_dict: bool = False, offload_buffers: bool = False,
                             keep_in_fp32_modules: list[str] | None = None, offload_8bit_bnb: bool = False,
                             strict: bool = False, full_state_dict: bool = True, broadcast_from_rank0: bool = False) -> None:
    """Load the weights ``save_model`` wrote (one file, a directory, or shards with their index) into
    ``model``, cast to ``dtype`` when given (modules named in ``keep_in_fp32_modules`` stay fp32).
    Placing the model over devices and disk (``device_map``, offloading) is inference dispatch,
    which lowbit does not do: those arguments raise, saying what to use."""
    import torch

    from lowbit.checkpoint.model_files import read_model_files

    placing = {"device_map": device_map, "offload_folder": offload_folder, "offload_state_dict": offload_state_dict,
               "offload_buffers": offload_buffers, "offload_8bit_bnb": offload_8bit_bnb}
    asked = [name for name, value in placing.items() if value]
    if asked:
        not_offered(f"load_checkpoint_in_model({asked[0]}=...)", INFERENCE_WHY, INFERENCE_USE)()  # raises
    state = read_model_files(checkpoint)
    if dtype is not None:
        keep = tuple(keep_in_fp32_modules or ())
        state = {key: value.to(torch.float32 if any(part in key.split(".") for part in keep) else dtype)
                 if torch.is_tensor(value) and value.is_floating_point() else value for key, value in state.items()}
    model.load_state_dict(state, strict=strict)


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(f"module 'lowbit.utils.modeling' has no attribute {name!r}")
    return not_offered(f"accelerate.utils.modeling.{name}", INFERENCE_WHY, INFERENCE_USE, is_class=name[:1].isupper())
