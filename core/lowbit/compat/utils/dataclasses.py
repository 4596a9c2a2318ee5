"""Accelerate's ``accelerate.utils.dataclasses`` path: the settings and handler classes, and the
recipe classes. ``FP8RecipeKwargs`` lives in the core; each backend's own class (``AORecipeKwargs``,
``TERecipeKwargs``, ``MSAMPRecipeKwargs``) in that backend's plugin, and always imports (as in
Accelerate): when the plugin is absent, the name is a placeholder that raises, with the install
command, only when a script creates one, so a script that names TE but trains on ao still runs."""

from __future__ import annotations

import importlib
from typing import Any

from lowbit.kernel.first_party import install_command
from lowbit.kernel.recipes import FP8RecipeKwargs, RecipeKwargs  # noqa: F401

from lowbit.run.layout import (  # noqa: F401
    DeepSpeedSequenceParallelConfig,
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)

from lowbit.compat.accelerate_names import (  # noqa: F401 - Accelerate's vocabularies
    ComputeEnvironment,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from lowbit.compat.handlers import (  # noqa: F401 - re-exported under Accelerate's names
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from lowbit.compat.state import DistributedType  # noqa: F401

# class name -> (module that defines it, backend whose plugin ships the module)
PLUGIN_CLASSES = {
    "AORecipeKwargs": ("lowbit_ao.recipe", "ao"),
    "TERecipeKwargs": ("lowbit_te.recipe", "te"),
    "MSAMPRecipeKwargs": ("lowbit_msamp.recipe", "msamp"),
}

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DDPCommunicationHookType",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
    "FP8RecipeKwargs",
    "RecipeKwargs",
    "DeepSpeedSequenceParallelConfig",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "DistributedType",
    "ComputeEnvironment",
    "DynamoBackend",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
]  # the PLUGIN_CLASSES stay lazy (__getattr__): each is looked up when named


def _missing_plugin_class(name: str, backend: str) -> type:
    """A stand-in class that fails on use, naming the plugin to install."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ImportError(
            f"{name} comes with the {backend} backend's plugin, which is not installed: {install_command(backend)}."
        )

    return type(
        name,
        (),
        {"__init__": refuse, "backend_name": backend, "__doc__": f"Install the {backend} plugin to use {name}."},
    )


def plugin_class(name: str) -> type:
    """A backend's recipe class from its plugin, or a placeholder naming the plugin to install."""
    module_name, backend = PLUGIN_CLASSES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return _missing_plugin_class(name, backend)
        raise
    return getattr(module, name)


def __getattr__(name: str) -> Any:
    if name in PLUGIN_CLASSES:
        return plugin_class(name)
    raise AttributeError(f"module 'lowbit.utils.dataclasses' has no attribute {name!r}")
