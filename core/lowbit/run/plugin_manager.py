"""The run's plugin manager: the plugins that ship in the core (:mod:`lowbit.runtime.builtin`,
registered first: a built-in keeps a name a plugin claims too), then ``extra_plugins``, then the
entry points. Handed over here, as modules, so the kernel's manager imports nothing above it."""

from __future__ import annotations

from typing import Any

from lowbit.kernel.manager import LowbitPluginManager, build_plugin_manager
from lowbit.kernel.registry import PluginRegistry

from lowbit.runtime.builtin import ddp, fsdp, hardware, trackers

BUILTIN_PLUGINS = (hardware, ddp, fsdp, trackers)


def make_plugin_manager(**options: Any) -> LowbitPluginManager:
    """A fresh manager with the built-ins; ``options`` as :func:`lowbit.kernel.manager.build_plugin_manager`'s."""
    return build_plugin_manager(BUILTIN_PLUGINS, **options)


def registry_for_names(manager: LowbitPluginManager | None = None) -> PluginRegistry:
    """The installed plugins' descriptions for the names they answer to (precisions, distributed
    types, sections, launch switches), without detecting hardware or importing torch."""
    return PluginRegistry.for_names(manager or make_plugin_manager())
