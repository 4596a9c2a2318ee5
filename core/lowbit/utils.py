"""Recipe-kwargs classes, importable as in Accelerate: ``from lowbit.utils import AORecipeKwargs``.

``FP8RecipeKwargs`` lives in the core. Each backend's own class lives in that backend's plugin,
so the core stays slim; importing one whose plugin is absent names the pip package to install.
"""
from __future__ import annotations

import importlib
from typing import Any

from lowbit.recipes import FP8RecipeKwargs, RecipeKwargs

# class name -> (module that defines it, distribution that ships the module)
PLUGIN_CLASSES = {
    "AORecipeKwargs": ("lowbit_ao.recipe", "lowbit-ao"),
    "TERecipeKwargs": ("lowbit_te.recipe", "lowbit-te"),
    "MSAMPRecipeKwargs": ("lowbit_msamp.recipe", "lowbit-msamp"),
}

__all__ = ["FP8RecipeKwargs", "RecipeKwargs", *PLUGIN_CLASSES]


def __getattr__(name: str) -> Any:
    if name not in PLUGIN_CLASSES:
        raise AttributeError(f"module 'lowbit.utils' has no attribute {name!r}")
    module_name, distribution = PLUGIN_CLASSES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ImportError(
                f"{name} comes with the {distribution} plugin, which is not installed: `pip install {distribution}`."
            ) from None
        raise
    return getattr(module, name)
