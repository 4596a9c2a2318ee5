"""The plugin system. This module builds the plugin manager: built-ins first, then entry points,
each loaded in isolation. Beside it: :mod:`lowbit.kernel.registry` (ranking and choosing backends
and strategies, with the reasons); elsewhere :mod:`lowbit.runtime.routing` (the chosen plugins, one
typed method per routed hook) and :mod:`lowbit.cli.scaffold` (``lowbit new-backend``). The
contract itself is :mod:`lowbit.kernel.hookspecs`; the data hooks exchange, :mod:`lowbit.kernel.types`.

Discovery is cheap by contract: loading an entry point imports only the plugin's small entry
module, never torch's heavy backends (transformer_engine, msamp, deepspeed, torchao).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy

from lowbit.kernel import hookspecs
from lowbit.kernel.env_numbers import env_switch
from lowbit.kernel.errors import ConfigError, PluginError
from lowbit.kernel.tracker import GeneralTracker

ENTRY_POINT_GROUP = "lowbit"
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
    load_seconds: float = 0.0


# A plugin whose entry module takes longer than this to import is named in `lowbit plugins`.
SLOW_IMPORT_SECONDS = 0.5


class LowbitPluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers where each plugin came from and which ones broke."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.strict = strict
        self.broken: list[BrokenPlugin] = []
        self.origins: dict[str, PluginOrigin] = {}
        self.builtin_names: set[str] = set()  # the plugins that ship in the core (they keep a name two plugins claim)

    def record_broken(self, name: str, distribution: str, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.strict:
            raise PluginError(f"plugin {name!r} from {distribution or 'unknown distribution'} is broken: {message}")
        if not any(b.name == name and b.error == message for b in self.broken):
            self.broken.append(BrokenPlugin(name, distribution, message))

    def origin(self, plugin: object) -> PluginOrigin:
        return self.origins.get(self.get_name(plugin) or "", PluginOrigin("lowbit (built-in)", ""))

    def detect_hardware(self, cpu: bool) -> Any:
        """The first detector's answer (pluggy's call order), skipping and reporting a detector
        that raises or returns something other than a ``HardwareInfo``."""
        from lowbit.kernel.types import HardwareInfo

        for impl in reversed(self.hook.detect_hardware.get_hookimpls()):
            origin = self.origin(impl.plugin)
            try:
                result = impl.function(cpu)
            except Exception as exc:  # noqa: BLE001 - isolation is the point
                self.record_broken(
                    impl.plugin_name, origin.distribution, f"detect_hardware raised {type(exc).__name__}: {exc}"
                )
                continue
            if result is None:
                continue
            if isinstance(result, HardwareInfo):
                return result
            self.record_broken(
                impl.plugin_name,
                origin.distribution,
                f"detect_hardware returned {_short_repr(result)}: expected a lowbit.kernel.types.HardwareInfo or None",
            )
        raise PluginError("No hardware detector answered (the built-in one was unregistered?).")

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[object, Any]]:
        """Call a broadcast hook on every plugin separately, so one that raises cannot stop the rest.

        Each result is checked against the hook's contract (:data:`RESULT_CONTRACTS`); a plugin
        that raises or returns the wrong thing is marked broken, naming the hook and the value.
        Returns (plugin, result) for each plugin that returned a valid non-None result.
        """
        results = []
        check = RESULT_CONTRACTS.get(hook_name)
        for impl in getattr(self.hook, hook_name).get_hookimpls():
            origin = self.origin(impl.plugin)
            try:
                result = impl.function(*[kwargs[arg] for arg in impl.argnames])
            except ConfigError:
                raise  # the user's input is wrong, not the plugin
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - isolation is the point
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                self.record_broken(impl.plugin_name, origin.distribution, f"{hook_name} raised {detail}")
                continue
            problem = check(result) if check is not None else ""
            if problem:
                self.record_broken(
                    impl.plugin_name, origin.distribution, f"{hook_name} returned {_short_repr(result)}: {problem}"
                )
                continue
            if result is not None:
                results.append((impl.plugin, result))
        return results


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _expects_plugin_description(result: Any) -> str:
    from lowbit.kernel.types import ROLES

    if result is None or isinstance(result, tuple(ROLES.values())):
        return ""
    records = ", ".join(f"lowbit.kernel.types.{record.__name__}" for record in ROLES.values())
    return f"expected one of {records} (the record of its role) or None, not {type(result).__name__}"


def _expects_env_mapping(result: Any) -> str:
    if result is None:
        return ""
    if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
        return f"expected a dict of env var names to values or None, not {type(result).__name__}"
    return ""


def _expects_none(result: Any) -> str:
    return "" if result is None else f"expected None (add flags to the parser), not {type(result).__name__}"


def _expects_tracker_classes(result: Any) -> str:
    if result is None:
        return ""
    if not isinstance(result, dict) or not all(
        isinstance(k, str) and isinstance(v, type) and issubclass(v, GeneralTracker) for k, v in result.items()
    ):
        return "expected a dict of tracker names to GeneralTracker subclasses (lowbit.tracking.GeneralTracker), or None"
    return ""


# What each broadcast hook may return; firstresult hooks are checked where they are used.
RESULT_CONTRACTS: dict[str, Callable[[Any], str]] = {
    "describe_backend": _expects_plugin_description,
    "launch_environment": _expects_env_mapping,
    "add_launch_arguments": _expects_none,
    "register_trackers": _expects_tracker_classes,
}


def _selected_entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    wanted = os.environ.get(PLUGINS_ENV)
    if wanted is None:
        return sorted(entry_points, key=lambda ep: ep.name)
    names = {n.strip() for n in wanted.split(",") if n.strip()}
    return sorted((ep for ep in entry_points if ep.name in names), key=lambda ep: ep.name)


def _strict_from_env() -> bool:
    return env_switch(STRICT_ENV, False)


def build_plugin_manager(
    builtins: Iterable[Any] = (),
    *,
    load_entry_points: bool = True,
    extra_plugins: Iterable[object] = (),
    strict: bool | None = None,
    entry_point_loader: Callable[[importlib.metadata.EntryPoint], object] | None = None,
) -> LowbitPluginManager:
    """Create a fresh manager: ``builtins`` (the core's own plugins, which its caller hands over:
    :mod:`lowbit.run.plugin_manager`), then ``extra_plugins`` (tests), then entry points.

    Each entry point loads inside its own try/except: a plugin that fails to import or registers
    badly is recorded in ``manager.broken`` and the others still load. ``check_pending`` then
    rejects hookimpls whose names match no spec (a typo in a plugin), again per plugin.
    """
    manager = LowbitPluginManager(strict=_strict_from_env() if strict is None else strict)
    for module in builtins:
        manager.register(module, name=module.__name__)
        manager.builtin_names.add(module.__name__)
    for plugin in extra_plugins:
        manager.register(plugin)
    if load_entry_points:
        load = entry_point_loader or (lambda ep: ep.load())
        for ep in _selected_entry_points():
            dist = ep.dist.name if ep.dist else ""
            version = ep.dist.version if ep.dist else ""
            started = time.perf_counter()
            # Two distributions may use one entry-point name (a third party's "ao" beside lowbit-ao):
            # the later one is registered under a name of its own, and what each plugin describes
            # itself as decides (registry.py: a first-party plugin keeps its name, others clash).
            name = ep.name if manager.get_plugin(ep.name) is None else f"{ep.name} ({dist or 'unknown distribution'})"
            try:
                plugin = load(ep)
                if manager.is_registered(plugin):
                    continue  # the same module named by two entry points
                manager.register(plugin, name=name)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - one broken plugin breaks nothing else
                # sys.exit() in a plugin's import would end the user's program; Ctrl-C still stops it.
                manager.record_broken(
                    name,
                    dist,
                    exc if not isinstance(exc, SystemExit) else f"called sys.exit({exc.code!r}) while being imported",
                )
                continue
            manager.origins[name] = PluginOrigin(dist, version, time.perf_counter() - started)
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
            attr for attr in dir(plugin) if manager.parse_hookimpl_opts(plugin, attr) is not None and attr not in known
        ]
        if unknown:
            manager.unregister(plugin)
            manager.record_broken(
                name,
                manager.origins.get(name, PluginOrigin("", "")).distribution,
                f"implements unknown hook(s) {', '.join(unknown)}; see lowbit/kernel/hookspecs.py for the valid names",
            )
