"""Accelerate's ``accelerate.utils`` names: recipe kwargs, settings objects, collective ops, seeding.

``FP8RecipeKwargs`` lives in the core. Each backend's own class lives in that backend's plugin,
so the core stays slim. ``TERecipeKwargs`` and friends always import (as in Accelerate): when
their plugin is absent, the name is a placeholder that raises, with the install command, only
when a script creates one; a script that names TE but trains on ao still runs.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import random as _random  # this package has a submodule named random (Accelerate's path)
from typing import Any

from lowbit.compat.accelerate_names import install_command
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
from lowbit.parallelism_config import ParallelismConfig, TorchContextParallelConfig, TorchTensorParallelConfig  # noqa: F401
from lowbit.training.local_sgd import LocalSGD  # noqa: F401
from lowbit.training.memory import clear_device_cache, find_executable_batch_size, release_memory  # noqa: F401
from lowbit.training.operations import (  # noqa: F401
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    gather,
    gather_object,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
)
from lowbit.config.recipes import FP8RecipeKwargs, RecipeKwargs
from lowbit.state import DistributedType  # noqa: F401
from lowbit.training.preparation import compile_regions  # noqa: F401

# class name -> (module that defines it, backend whose plugin ships the module)
PLUGIN_CLASSES = {
    "AORecipeKwargs": ("lowbit_ao.recipe", "ao"),
    "TERecipeKwargs": ("lowbit_te.recipe", "te"),
    "MSAMPRecipeKwargs": ("lowbit_msamp.recipe", "msamp"),
}

# Accelerate's `is_<name>_available()` helpers that training scripts test before importing an
# optional library: name -> the module whose presence answers it.
OPTIONAL_LIBRARIES = {
    "schedulefree": "schedulefree", "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
    "comet_ml": "comet_ml", "aim": "aim", "clearml": "clearml", "dvclive": "dvclive", "deepspeed": "deepspeed",
    "transformer_engine": "transformer_engine", "msamp": "msamp", "torchao": "torchao", "datasets": "datasets",
    "transformers": "transformers", "rich": "rich", "bnb": "bitsandbytes", "peft": "peft", "timm": "timm",
}
AVAILABILITY_CHECKS = {f"is_{name}_available": module for name, module in OPTIONAL_LIBRARIES.items()}

__all__ = [*AVAILABILITY_CHECKS, 
    "FP8RecipeKwargs", "RecipeKwargs", *PLUGIN_CLASSES, "set_seed", "tqdm", "extract_model_from_parallel",
    "get_grad_scaler", "LocalSGD", "DistributedType", "ProjectConfiguration", "DataLoaderConfiguration",
    "GradientAccumulationPlugin", "FullyShardedDataParallelPlugin", "DeepSpeedPlugin", "TorchDynamoPlugin",
    "synchronize_rng_states", "ParallelismConfig", "TorchTensorParallelConfig", "TorchContextParallelConfig",
    "DistributedDataParallelKwargs", "DDPCommunicationHookType", "GradScalerKwargs", "InitProcessGroupKwargs",
    "AutocastKwargs", "ProfileKwargs", "KwargsHandler", "find_executable_batch_size", "release_memory", "gather",
    "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes", "send_to_device",
    "recursively_apply", "compile_regions", "listify", "concatenate", "convert_to_fp32", "convert_outputs_to_fp32",
]


def _missing_plugin_class(name: str, backend: str) -> type:
    """A stand-in class that fails on use, naming the plugin to install."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ImportError(f"{name} comes with the {backend} backend's plugin, which is not installed: {install_command(backend)}.")

    return type(name, (), {"__init__": refuse, "backend_name": backend, "__doc__": f"Install the {backend} plugin to use {name}."})


def availability_check(name: str) -> Any:
    """``is_<library>_available``: a function answering whether the library can be imported."""
    module = AVAILABILITY_CHECKS[name]
    return lambda: importlib.util.find_spec(module) is not None


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
    if name in AVAILABILITY_CHECKS:
        return availability_check(name)
    if name in PLUGIN_CLASSES:
        return plugin_class(name)
    raise AttributeError(f"module 'lowbit.utils' has no attribute {name!r}")


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy (when installed) and torch; ``device_specific`` adds the process index."""
    import torch

    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    _random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_states(rng_types: list[Any], generator: Any = None) -> None:
    """Give every process the main process's random state for each of ``rng_types`` ("torch",
    "cuda", "generator": ``generator``'s), so that they draw the same numbers from here on."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for kind in (str(getattr(t, "value", t)).lower() for t in rng_types):
        if kind == "torch":
            states = [torch.get_rng_state()]
        elif kind == "cuda":
            states = [torch.cuda.get_rng_state()] if torch.cuda.is_available() else []
        elif kind == "generator":
            states = [generator.get_state()] if generator is not None else []
        else:
            raise ValueError(f"rng_types: {kind!r} is not one of torch, cuda, generator.")
        if not states:
            continue
        dist.broadcast_object_list(states, src=0)
        {"torch": torch.set_rng_state, "cuda": lambda s: torch.cuda.set_rng_state(s),
         "generator": lambda s: generator.set_state(s)}[kind](states[0])


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown on the local main process only (unless main_process_only=False)."""
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)


def extract_model_from_parallel(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> Any:
    """The model inside DDP / DataParallel / DeepSpeed wrappers (compiled when it was compiled
    itself and ``keep_torch_compile``). ``recursive``: accepted; lowbit's wrappers are all at the top."""
    from lowbit.training.preparation import unwrap

    return unwrap(model, keep_fp32_wrapper, keep_torch_compile)


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> Any:
    import torch

    return torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu", **kwargs)
