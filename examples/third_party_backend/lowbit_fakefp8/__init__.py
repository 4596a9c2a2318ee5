"""A complete third-party lowbit backend in one file: the walk-through in docs/writing-a-backend.md.

It rounds every eligible Linear's weight to FP8 (e4m3, one scale per tensor) in the forward pass
and lets gradients through unchanged (a straight-through estimator): FP8 weight numerics on any
device, no FP8 hardware needed. Priority 50, so the real backends win when they are usable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lowbit.kernel.plugin_api import (
    BackendDescription,
    HardwareInfo,
    PrepareContext,
    RecipeKwargs,
    hookimpl,
    recipe_option,
)


@dataclass
class FakeFP8RecipeKwargs(RecipeKwargs):
    backend_name: ClassVar[str] = "fakefp8"
    min_features: int | None = recipe_option(16, type=int, help="skip Linears smaller than this")


@hookimpl
def describe_backend(hardware: HardwareInfo) -> BackendDescription:
    import importlib.util

    # Cheap: ask whether torch has float8 types without importing torch here.
    has_torch = importlib.util.find_spec("torch") is not None
    return BackendDescription(
        name="fakefp8",
        priority=50,
        available=has_torch,
        reason="" if has_torch else "torch not installed",
        options_class=FakeFP8RecipeKwargs,
    )


@hookimpl
def convert_model(model, context: PrepareContext):
    from lowbit_fakefp8.layers import FakeFP8Linear

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (
                type(child).__name__ == "Linear"
                and min(child.in_features, child.out_features) >= context.backend_options.min_features
            ):
                setattr(module, name, FakeFP8Linear.from_linear(child))
    return model
