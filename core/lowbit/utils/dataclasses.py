"""Accelerate's ``accelerate.utils.dataclasses`` path: the settings and handler classes."""
from lowbit.compat.handlers import (  # noqa: F401 - re-exported under Accelerate's path
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
from lowbit.config.recipes import FP8RecipeKwargs, RecipeKwargs  # noqa: F401
from lowbit.parallelism_config import TorchContextParallelConfig, TorchTensorParallelConfig  # noqa: F401
from lowbit.state import DistributedType  # noqa: F401
from lowbit.utils import PLUGIN_CLASSES, plugin_class


def __getattr__(name: str):
    if name in PLUGIN_CLASSES:  # AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs: from their plugins
        return plugin_class(name)
    raise AttributeError(f"module 'lowbit.utils.dataclasses' has no attribute {name!r}")
