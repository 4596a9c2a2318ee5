"""Transformer Engine's FP8 scaling state in lowbit checkpoints, as plain tensors: no pickle.

TE 2.x keeps a module's delayed-scaling state (a scale per quantized tensor, the amax history)
in ``fp8_meta`` and writes it into the module's ``_extra_state`` as a pickled byte tensor that
also holds the recipe object (``module/base.py`` ``get_extra_state``, 2.9.0 and 2.20.2). That
fails lowbit three ways:

* loading it runs the pickle: TE 2.9 unpickles whatever the file holds, which breaks lowbit's
  promise that a checkpoint never runs code on load; TE 2.20 refuses it unless
  ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (``pytorch/_extra_state.py``), so a resume fails;
* TE writes an empty ``_extra_state`` when the module's last forward ran outside FP8 autocast
  (``fp8_checkpoint`` is reset by every forward): a save right after an eval pass loses the
  amax history;
* under FSDP2, torch.distributed.checkpoint compares the saved byte tensor's size with the load
  target's, which is empty until the target has run a forward (TE issue 1860).

So lowbit-te keeps ``_extra_state`` empty in every state dict of a model it prepared (a
post-hook on each TE module), and ``save_state`` writes the same state TE would have pickled,
minus the recipe, as tensors and numbers in a file of its own (read back with
``torch.load(weights_only=True)``). Loading does what TE's ``set_extra_state`` does after
unpickling: set the plain metadata and lowbit's recipe, let TE allocate its state, copy the
tensors in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.kernel.plugin_api import note

EXTRA_STATE = "_extra_state"
# fp8_meta key -> the names TE's own extra state uses for its two tensors.
SCALING_TENSORS = {"scaling_fwd": ("scale_fwd", "amax_history_fwd"), "scaling_bwd": ("scale_bwd", "amax_history_bwd")}
_PLAIN = (bool, int, float, str)
# TE's slot for this module in a per-process list (FP8GlobalStateManager's
# fp8_tensors_recompute_buffer, filled by activation recompute): TE's own set_extra_state deletes
# it (module/base.py, 2.9.0 and 2.20.2), since a restored index points past a new process's empty
# list (IndexError at the first forward under te.distributed.checkpoint).
RECOMPUTE_BUFFER_KEY = "global_fp8_buffer_pos_fwd_recompute"
# fp8_meta keys that belong to this process, not to the model: never saved.
PER_PROCESS_KEYS = ("buffer_index_and_autocast_key", RECOMPUTE_BUFFER_KEY)


def te_fp8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that carry TE FP8 metadata (TransformerEngineBaseModule: Linear, LayerNormLinear, ...)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(getattr(module, "fp8_meta", None), dict)
        and callable(getattr(module, "init_fp8_meta_tensors", None))
    }


def _empty_extra_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    key = prefix + EXTRA_STATE
    if key in state_dict:
        state_dict[key] = torch.empty(0, dtype=torch.uint8)  # what TE itself writes for "no FP8 state"


def keep_pickles_out_of_state_dicts(model: nn.Module) -> None:
    """Every TE module of ``model`` reports an empty ``_extra_state`` from now on (idempotent)."""
    for module in te_fp8_modules(model).values():
        if not getattr(module, "_lowbit_extra_state_hook", False):
            module.register_state_dict_post_hook(_empty_extra_state)
            module._lowbit_extra_state_hook = True


def _plain_value(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def scaling_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{module name: {"scale_fwd": ..., "amax_history_fwd": ..., ..., "extra_fp8_variables": {...}}}``
    for every TE module holding delayed-scaling state, whatever its last forward was."""
    state = {}
    for name, module in te_fp8_modules(model).items():
        meta = module.fp8_meta
        if not all(hasattr(meta.get(key), "amax_history") for key in SCALING_TENSORS):
            continue  # not run yet, or a recipe without state (current, block, MXFP8, NVFP4)
        entry: dict[str, Any] = {}
        for key, (scale_name, history_name) in SCALING_TENSORS.items():
            entry[scale_name] = meta[key].scale.detach().to("cpu", copy=True)
            entry[history_name] = meta[key].amax_history.detach().to("cpu", copy=True)
        entry["extra_fp8_variables"] = {k: v for k, v in meta.items() if k not in PER_PROCESS_KEYS and _plain_value(v)}
        state[name] = entry
    return state


def load_scaling_state(model: nn.Module, state: dict[str, dict[str, Any]], recipe: Any) -> None:
    """Put :func:`scaling_state`'s output back, as TE's ``set_extra_state`` would after unpickling."""
    modules = te_fp8_modules(model)
    unknown = sorted(set(state) - set(modules))
    if unknown:
        raise ValueError(f"FP8 scaling state for module(s) this model does not have: {', '.join(unknown[:5])}")
    if state and not recipe.delayed():
        # Saved under delayed scaling, resumed under a recipe that keeps no amax history (current,
        # block, MXFP8, NVFP4 compute their scales from each tensor): the weights carry over, the
        # histories have nowhere to go. TE itself would fail here (no amax_history to copy into).
        note(
            f"lowbit-te: this checkpoint holds delayed-scaling state (amax histories of {len(state)} module(s)); "
            f"this run's recipe ({type(recipe).__name__}) computes its scales from each tensor and keeps none, "
            "so the histories are not restored. The weights and optimizer state are."
        )
        return
    for name, entry in state.items():
        module = modules[name]
        module.fp8_meta.update({k: v for k, v in entry["extra_fp8_variables"].items() if k not in PER_PROCESS_KEYS})
        module.fp8_meta.pop(RECOMPUTE_BUFFER_KEY, None)  # this process's own slot is stale after a load too, as in TE
        module.fp8_meta["recipe"] = recipe
        module.init_fp8_meta_tensors(recipe)
        with torch.no_grad():
            for key, (scale_name, history_name) in SCALING_TENSORS.items():
                target = module.fp8_meta[key]
                if target.amax_history.shape != entry[history_name].shape:
                    raise ValueError(
                        f"{name}: the saved amax history has shape {tuple(entry[history_name].shape)}, this run's "
                        f"{tuple(target.amax_history.shape)} (amax_history_len changed?)"
                    )
                target.scale.copy_(entry[scale_name])
                target.amax_history.copy_(entry[history_name])


def without_pickled_extra_state(state: dict[str, Any]) -> dict[str, Any] | None:
    """A model state dict with TE's pickled ``_extra_state`` entries emptied (a checkpoint written
    before lowbit kept them out, or by TE itself): lowbit never unpickles. None when there were none."""
    pickled = [
        k
        for k, v in state.items()
        if k.endswith(EXTRA_STATE) and isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.numel()
    ]
    if not pickled:
        return None
    note(
        f"lowbit-te: {len(pickled)} module(s) of this checkpoint hold Transformer Engine's pickled FP8 state "
        f"({pickled[0]}, ...); lowbit does not unpickle checkpoint data, so their amax histories start afresh "
        "(they refill within amax_history_len steps). Checkpoints saved by this lowbit keep that state as plain "
        "tensors."
    )
    return {k: (torch.empty(0, dtype=torch.uint8) if k in pickled else v) for k, v in state.items()}
