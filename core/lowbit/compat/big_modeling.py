"""Accelerate's ``big_modeling`` names. Building a model without memory (``init_empty_weights``,
``init_on_device``) serves training too, and is here; spreading a model over devices and disk for
inference (``dispatch_model``, ``cpu_offload``, ...) is not lowbit's job: those raise, saying what
to use instead. ``load_checkpoint_in_model`` loads saved weights (without placing them): lowbit has it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from lowbit.compat.accelerate_names import INFERENCE_USE, INFERENCE_WHY, not_offered

INFERENCE_DISPATCH = (
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "infer_auto_device_map",
    "load_checkpoint_and_dispatch",
    "attach_layerwise_casting_hooks",
)


@contextlib.contextmanager
def init_on_device(device: Any, include_buffers: bool | None = None) -> Iterator[None]:
    """Modules built inside get their parameters on ``device`` (``"meta"``: no memory at all), and
    their buffers too with ``include_buffers=True``."""
    import torch

    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = torch.nn.Module.register_parameter

    def register_parameter(module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None and param.device != device:  # re-made on the device, same class and requires_grad
            param = type(param)(param.to(device), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def init_empty_weights(include_buffers: bool | None = None) -> contextlib.AbstractContextManager:
    """``init_on_device("meta")``: a model of any size built in no memory (load or materialize it after)."""
    return init_on_device("meta", include_buffers=include_buffers)


globals().update(
    {name: not_offered(f"accelerate.big_modeling.{name}", INFERENCE_WHY, INFERENCE_USE) for name in INFERENCE_DISPATCH}
)


def __getattr__(name: str) -> Any:
    if name == "load_checkpoint_in_model":  # loading saved weights serves training too: lowbit has it
        from lowbit.compat.utils.modeling import load_checkpoint_in_model

        return load_checkpoint_in_model
    raise AttributeError(f"module 'lowbit.big_modeling' has no attribute {name!r}")
