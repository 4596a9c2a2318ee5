"""Accelerate's ``accelerate.utils.modeling`` path. Most of it places a model over devices and disk
for inference, which lowbit does not do: those names import and raise on use, saying what to use.
``has_offloaded_params`` answers for a model placed that way by Accelerate or transformers."""
from __future__ import annotations

from typing import Any

from lowbit.big_modeling import USE, WHY
from lowbit.compat.accelerate_names import not_offered

__all__ = ["has_offloaded_params"]


def has_offloaded_params(module: Any) -> bool:
    """Whether ``module`` carries an offloading hook (Accelerate's ``_hf_hook`` with ``offload``,
    as transformers' ``device_map`` loading leaves it): its weights live elsewhere between forwards."""
    return bool(getattr(getattr(module, "_hf_hook", None), "offload", False))


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(f"module 'lowbit.utils.modeling' has no attribute {name!r}")
    return not_offered(f"accelerate.utils.modeling.{name}", WHY, USE, is_class=name[:1].isupper())
