"""Accelerate's ``accelerate.utils`` names: recipe kwargs, settings objects, collective ops, seeding.

Each name is defined (or re-exported) in the submodule of Accelerate's path (``utils.dataclasses``,
``utils.operations``, ``utils.memory``, ``utils.random``, ``utils.other``, ``utils.imports``,
``utils.versions``, ``utils.environment``, ``utils.constants``, ``utils.modeling``); this package
gathers them, as ``accelerate.utils`` does, loading a submodule when one of its names is first
asked for: ``from lowbit.utils import set_seed`` loads the seeding module, not the preparation.
"""

from __future__ import annotations

import importlib
from typing import Any

# The submodules whose public names (``__all__``) this package gathers, looked in for a name in
# this order: the light ones first.
GATHERED = (
    "random",
    "environment",
    "imports",
    "memory",
    "operations",
    "other",
    "modeling",
    "dataclasses",
    "fsdp_utils",
)
# Accelerate's other submodule paths (importable as attributes too).
SUBMODULES = (*GATHERED, "constants", "deepspeed", "versions")
# Names gathered from elsewhere -> the module that defines them.
SINGLE_NAMES = {
    "LocalSGD": "lowbit.runtime.training.local_sgd",
    "compile_regions": "lowbit.runtime.training.preparation",
    "compare_versions": "lowbit.compat.utils.versions",
    "is_torch_version": "lowbit.compat.utils.versions",
    **{
        name: "lowbit.compat.utils.deepspeed"
        for name in (
            "DummyOptim",
            "DummyScheduler",
            "DeepSpeedSchedulerWrapper",
            "DeepSpeedOptimizerWrapper",
            "DeepSpeedEngineWrapper",
            "HfDeepSpeedConfig",
        )
    },
}


def _submodule(name: str) -> Any:
    return importlib.import_module(f"{__name__}.{name}")


_MISSING = object()


def _defined_name(name: str) -> Any:
    """A name one of the submodules defines (or a submodule), else _MISSING."""
    if name in SINGLE_NAMES:
        return getattr(importlib.import_module(SINGLE_NAMES[name]), name)
    if name in SUBMODULES:
        return _submodule(name)
    for sub in GATHERED:
        module = _submodule(sub)
        if name in module.__all__:
            return getattr(module, name)
    return _MISSING


def _all_names() -> list[str]:
    dataclasses = _submodule("dataclasses")
    return [*(n for sub in GATHERED for n in _submodule(sub).__all__), *dataclasses.PLUGIN_CLASSES, *SINGLE_NAMES]


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return _all_names()
    value = _defined_name(name)
    if value is not _MISSING:
        globals()[name] = value  # found once: later lookups (a loop calling utils.gather) are plain attributes
        return value
    dataclasses = _submodule("dataclasses")
    if name in dataclasses.PLUGIN_CLASSES:  # from its plugin, when installed
        return dataclasses.plugin_class(name)
    from lowbit.compat.utils.refused import REFUSED, refused

    if name in REFUSED:  # jobs lowbit does not do: the name imports and refuses when used
        return refused(name)
    raise AttributeError(f"module 'lowbit.utils' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_all_names(), *SUBMODULES})
