"""Accelerate's ``accelerate.utils`` names: recipe kwargs, settings objects, collective ops, seeding.

Each name is defined (or re-exported) in the submodule of Accelerate's path (``utils.dataclasses``,
``utils.operations``, ``utils.memory``, ``utils.random``, ``utils.other``, ``utils.imports``,
``utils.versions``, ``utils.environment``, ``utils.constants``, ``utils.modeling``); this package gathers them, as ``accelerate.utils`` does.
"""
from __future__ import annotations

from typing import Any

from lowbit.training.local_sgd import LocalSGD  # noqa: F401
from lowbit.training.preparation import compile_regions  # noqa: F401
from lowbit.utils.modeling import *  # noqa: F401,F403
from lowbit.utils.versions import compare_versions, is_torch_version  # noqa: F401
from lowbit.utils import dataclasses, environment, imports, memory, modeling, operations, other, random
from lowbit.utils.refused import REFUSED, refused
from lowbit.utils.dataclasses import *  # noqa: F401,F403
from lowbit.utils.environment import *  # noqa: F401,F403
from lowbit.utils.imports import (  # noqa: F401
    is_bf16_available, is_cuda_available, is_fp16_available, is_mps_available, is_npu_available, is_xpu_available)
from lowbit.utils.memory import *  # noqa: F401,F403
from lowbit.utils.operations import *  # noqa: F401,F403
from lowbit.utils.other import *  # noqa: F401,F403
from lowbit.utils.random import *  # noqa: F401,F403

__all__ = [*dataclasses.__all__, *environment.__all__, *imports.__all__, *memory.__all__, *operations.__all__, *other.__all__, *random.__all__,
           *dataclasses.PLUGIN_CLASSES, *modeling.__all__, "LocalSGD", "compile_regions", "compare_versions",
           "is_torch_version"]


def __getattr__(name: str) -> Any:
    if name in dataclasses.PLUGIN_CLASSES:  # from its plugin, when installed
        return dataclasses.plugin_class(name)
    if name in imports.AVAILABILITY_CHECKS:
        return imports.availability_check(name)
    if name in REFUSED:  # jobs lowbit does not do: the name imports and refuses when used
        return refused(name)
    raise AttributeError(f"module 'lowbit.utils' has no attribute {name!r}")
