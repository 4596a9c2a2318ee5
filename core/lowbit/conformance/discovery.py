"""Checks on how a plugin is found: what it says about itself, and what loading it imports."""

from __future__ import annotations

import json
import subprocess
import sys

from lowbit.conformance.setup import fail, make_manager

from lowbit.kernel.registry import PluginRegistry
from lowbit.kernel.types import BackendDescription, HardwareInfo

from lowbit.run.plugin_manager import registry_for_names


def backend_library_modules() -> tuple[str, ...]:
    """Never imported while lowbit discovers plugins (discovery runs at every start, on every rank):
    torch, and the top-level modules of every library the installed plugins say they drive
    (``BackendDescription.libraries``, distribution names)."""
    import importlib.metadata

    libraries = {
        lib.lower().replace("_", "-") for c in registry_for_names().candidates for lib in c.description.libraries
    }
    modules = [
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if any(d.lower().replace("_", "-") in libraries for d in dists)
    ]
    return ("torch", *sorted(set(modules)))


def check_description(
    backend: str, plugin: object | None = None, hardware: HardwareInfo | None = None
) -> BackendDescription:
    """The backend describes itself: int priority, a known kind, a string reason (non-empty when unavailable)."""
    manager = make_manager(plugin, hardware)
    registry = PluginRegistry(manager, manager.detect_hardware(cpu=False))
    names = {backend} | ({manager.get_name(plugin)} if plugin is not None else set())
    broken = [b.error for b in manager.broken if b.name in names]
    if broken:
        fail(backend, "describe_backend", f"the plugin is broken: {broken}")
    found = [c for c in registry.candidates if c.matches(backend)]
    if not found:
        fail(
            backend,
            "describe_backend",
            f"no installed plugin describes a backend named {backend!r} "
            "(is the distribution installed, with an entry point in the 'lowbit' group?)",
        )
    description = found[0].description
    if not isinstance(description.priority, int) or isinstance(description.priority, bool):
        fail(backend, "describe_backend", f"priority must be an int, got {description.priority!r}")
    if not isinstance(description.reason, str):
        fail(backend, "describe_backend", f"reason must be a string, got {description.reason!r}")
    if not (description.available or description.reason):
        fail(backend, "describe_backend", "an unavailable backend must say why (reason is empty)")
    return description


def check_discovery_is_cheap(entry_point: str, heavy_modules: tuple[str, ...] = ()) -> None:
    """Loading the plugin and describing it imports none of ``heavy_modules``, torch, nor a known
    backend library (checked in a fresh interpreter)."""
    heavy = tuple(heavy_modules) + backend_library_modules()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowbit.conformance.import_probe",
            "discovery",
            "--plugins",
            entry_point,
            "--heavy",
            *heavy,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = json.loads(proc.stdout.strip().splitlines()[-1])["imported"]
    if imported:
        fail(
            entry_point,
            "discovery (the entry module and describe_backend)",
            f"imported {imported}; import them inside the hooks that run once the backend is chosen (convert_model, "
            "...)",
        )
