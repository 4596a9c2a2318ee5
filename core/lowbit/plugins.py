"""Build the plugin manager: built-ins first, then entry points, each loaded in isolation.

Discovery is cheap by contract: loading an entry point imports only the plugin's small entry
module, never torch's heavy backends (transformer_engine, msamp, deepspeed, torchao).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy

from lowbit import hookspecs
from lowbit.errors import ConfigError, PluginError

ENTRY_POINT_GROUP = "lowbit"
BUILTIN_PLUGINS = (
    "lowbit.builtin.hardware",
    "lowbit.builtin.native_amp",
    "lowbit.builtin.ddp",
    "lowbit.builtin.fsdp",
)
# Comma-separated entry-point names to load; set but empty loads only the built-ins.
PLUGINS_ENV = "LOWBIT_PLUGINS"
# "1" turns a broken plugin into an error instead of a report line.
STRICT_ENV = "LOWBIT_STRICT_PLUGINS"


@dataclass
class BrokenPlugin:
    """A plugin that raised while loading or while describing itself."""

    name: str
    distribution: str
    error: str

    def describe(self) -> str:
        return f"{self.name} ({self.distribution or 'unknown distribution'}): {self.error}"


@dataclass
class PluginOrigin:
    distribution: str
    version: str


class LowbitPluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers where each plugin came from and which ones broke."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.strict = strict
        self.broken: list[BrokenPlugin] = []
        self.origins: dict[str, PluginOrigin] = {}

    def record_broken(self, name: str, distribution: str, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.strict:
            raise PluginError(f"plugin {name!r} from {distribution or 'unknown distribution'} is broken: {message}")
        if not any(b.name == name and b.error == message for b in self.broken):
            self.broken.append(BrokenPlugin(name, distribution, message))

    def origin(self, plugin: object) -> PluginOrigin:
        return self.origins.get(self.get_name(plugin) or "", PluginOrigin("lowbit (built-in)", ""))

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[object, Any]]:
        """Call a broadcast hook on every plugin separately, so one that raises cannot stop the rest.

        Returns (plugin, result) for each plugin that returned a non-None result.
        """
        results = []
        for impl in getattr(self.hook, hook_name).get_hookimpls():
            origin = self.origin(impl.plugin)
            try:
                result = impl.function(*[kwargs[arg] for arg in impl.argnames])
            except ConfigError:
                raise  # the user's input is wrong, not the plugin
            except Exception as exc:  # noqa: BLE001 - isolation is the point
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                self.record_broken(impl.plugin_name, origin.distribution, f"{hook_name} raised {detail}")
                continue
            if result is not None:
                results.append((impl.plugin, result))
        return results


def _selected_entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    wanted = os.environ.get(PLUGINS_ENV)
    if wanted is None:
        return sorted(entry_points, key=lambda ep: ep.name)
    names = {n.strip() for n in wanted.split(",") if n.strip()}
    return sorted((ep for ep in entry_points if ep.name in names), key=lambda ep: ep.name)


def _strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes"}


def make_plugin_manager(
    *,
    load_entry_points: bool = True,
    extra_plugins: Iterable[object] = (),
    strict: bool | None = None,
    entry_point_loader: Callable[[importlib.metadata.EntryPoint], object] | None = None,
) -> LowbitPluginManager:
    """Create a fresh manager: built-ins, then ``extra_plugins`` (tests), then entry points.

    Each entry point loads inside its own try/except: a plugin that fails to import or registers
    badly is recorded in ``manager.broken`` and the others still load. ``check_pending`` then
    rejects hookimpls whose names match no spec (a typo in a plugin), again per plugin.
    """
    manager = LowbitPluginManager(strict=_strict_from_env() if strict is None else strict)
    for module_name in BUILTIN_PLUGINS:
        manager.register(importlib.import_module(module_name), name=module_name)
    for plugin in extra_plugins:
        manager.register(plugin)
    if load_entry_points:
        load = entry_point_loader or (lambda ep: ep.load())
        for ep in _selected_entry_points():
            dist = ep.dist.name if ep.dist else ""
            version = ep.dist.version if ep.dist else ""
            try:
                plugin = load(ep)
                if manager.is_registered(plugin):
                    continue  # the same module named by two entry points
                manager.register(plugin, name=ep.name)
            except Exception as exc:  # noqa: BLE001 - one broken plugin breaks nothing else
                manager.record_broken(ep.name, dist, exc)
                continue
            manager.origins[ep.name] = PluginOrigin(dist, version)
    _check_pending_per_plugin(manager)
    return manager


def _check_pending_per_plugin(manager: LowbitPluginManager) -> None:
    try:
        manager.check_pending()
        return
    except pluggy.PluginValidationError:
        pass
    # Find the culprits one by one, unregister them, report them.
    known = {name for name, caller in vars(manager.hook).items() if caller.has_spec()}
    for name, plugin in list(manager.list_name_plugin()):
        unknown = [
            attr
            for attr in dir(plugin)
            if manager.parse_hookimpl_opts(plugin, attr) is not None and attr not in known
        ]
        if unknown:
            manager.unregister(plugin)
            manager.record_broken(
                name, manager.origins.get(name, PluginOrigin("", "")).distribution,
                f"implements unknown hook(s) {', '.join(unknown)}; see lowbit/hookspecs.py for the valid names",
            )
