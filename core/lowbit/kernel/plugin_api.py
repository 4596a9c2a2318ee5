"""What a plugin imports from lowbit, in one place: ``from lowbit.kernel.plugin_api import ...``.

The hook marker and the records hooks exchange, the errors and notices a plugin raises or gives,
the recipe-options vocabulary, version checks, and the helpers backends share (token padding for
FP8 GEMMs, cast statistics, the CPU's bf16 support), each loaded on first use so that discovering
a plugin stays free of torch. A plugin needs nothing else of lowbit (``tests/test_layers.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

from lowbit.kernel.errors import (  # noqa: F401
    BackendUnavailableError,
    ConfigError,
    PluginError,
    UnsupportedCombinationError,
    did_you_mean,
)
from lowbit.kernel.hookspecs import hookimpl  # noqa: F401
from lowbit.kernel.layer_roles import LayerRole, LayerRoles  # noqa: F401
from lowbit.kernel.notices import LowbitNote, note  # noqa: F401
from lowbit.kernel.options import at_least  # noqa: F401
from lowbit.kernel.recipes import (  # noqa: F401
    FP4RecipeOptions,
    RecipeKwargs,
    fp4_layers_kept_bf16,
    recipe_launch_hooks,
    recipe_name_option,
    recipe_option,
)
from lowbit.kernel.types import (  # noqa: F401
    BackendDescription,
    ConversionReport,
    ConvertedModel,
    HardwareInfo,
    PrepareContext,
    RecipeCost,
    StrategyDescription,
    StrategyIntegration,
    StrategyMemory,
)
from lowbit.kernel.version import installed_version, older_than  # noqa: F401

# Helpers that need torch -> their kernel module, imported when a plugin first asks for one.
_NEED_TORCH = {
    "pad_tokens": "lowbit.kernel.token_padding",
    "block_cast_stats": "lowbit.kernel.telemetry",
    "cast_stats": "lowbit.kernel.telemetry",
    "cpu_has_native_bf16": "lowbit.kernel.cpu_features",
}


def __getattr__(name: str) -> Any:
    if name in _NEED_TORCH:
        return getattr(importlib.import_module(_NEED_TORCH[name]), name)
    raise AttributeError(f"module 'lowbit.kernel.plugin_api' has no attribute {name!r}")
