"""Conformance checks a backend plugin runs in its own test suite to prove it keeps the contract.

    from lowbit.testing import run_conformance

    def test_my_backend_honours_the_lowbit_contract(tmp_path):
        run_conformance("mybackend", heavy_modules=("my_fp8_lib",), tmp_path=tmp_path)

Each check is also a function of its own. They raise ``AssertionError`` with a message that
says what broke. The backend must be available on the machine the tests run on; pass
``hardware=`` (and ``plugin=`` for an object not installed through an entry point) to test it
on a stand-in.
"""
from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Callable

from lowbit.plugins import LowbitPluginManager, make_plugin_manager
from lowbit.selection import BackendRegistry
from lowbit.types import BackendDescription, HardwareInfo

# Never imported while lowbit discovers plugins.
BACKEND_LIBRARIES = ("transformer_engine", "msamp", "deepspeed", "torchao")


def _manager(plugin: object | None, hardware: HardwareInfo | None) -> LowbitPluginManager:
    extra: list[object] = [] if plugin is None else [plugin]
    if hardware is not None:
        from lowbit.hookspecs import hookimpl

        class _Hardware:
            @hookimpl(tryfirst=True)
            def detect_hardware(self, cpu: bool) -> HardwareInfo:
                return hardware

        extra.append(_Hardware())
    return make_plugin_manager(extra_plugins=extra)


def default_model_factory():
    """A small model whose Linears FP8 GEMMs can take (dims multiples of 16)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64))


def check_description(backend: str, plugin: object | None = None, hardware: HardwareInfo | None = None) -> BackendDescription:
    """The backend describes itself: int priority, a known kind, a string reason (non-empty when unavailable)."""
    manager = _manager(plugin, hardware)
    registry = BackendRegistry(manager, manager.detect_hardware(cpu=False))
    names = {backend} | ({manager.get_name(plugin)} if plugin is not None else set())
    broken = [b.error for b in manager.broken if b.name in names]
    assert not broken, f"plugin is broken: {broken}"
    found = [c for c in registry.candidates if c.matches(backend)]
    assert found, f"no installed plugin describes a backend named {backend!r}"
    description = found[0].description
    assert isinstance(description.priority, int) and not isinstance(description.priority, bool), "priority must be an int"
    assert isinstance(description.reason, str), "reason must be a string"
    assert description.available or description.reason, "an unavailable backend must say why"
    return description


def check_discovery_is_cheap(entry_point: str, heavy_modules: tuple[str, ...] = ()) -> None:
    """Loading the plugin and describing it imports none of ``heavy_modules`` nor a backend library."""
    heavy = tuple(heavy_modules) + BACKEND_LIBRARIES
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["LOWBIT_PLUGINS"] = {entry_point!r}
        from lowbit.plugins import make_plugin_manager
        from lowbit.selection import BackendRegistry
        from lowbit.types import HardwareInfo
        manager = make_plugin_manager()
        BackendRegistry(manager, HardwareInfo("cpu", "CPU"))
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r})))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    assert out == "[]", f"discovering {entry_point!r} imported {out}; import them inside the hooks that need them"


def _prepare(backend: str, plugin: object | None, hardware: HardwareInfo | None, model):
    from lowbit import Accelerator
    from lowbit.recipes import FP8RecipeKwargs

    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend=backend)],
                      plugin_manager=_manager(plugin, hardware))
    assert acc.fp8_backend is not None, f"{backend!r} was not chosen"
    return acc, acc.prepare(model)


def check_conversion_keeps_outputs_close(
    backend: str, plugin: object | None = None, hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory, rtol: float = 0.1,
) -> float:
    """The converted model's outputs stay within ``rtol`` (relative L2 error) of the plain model's."""
    import torch

    plain = model_factory()
    converted_from = copy.deepcopy(plain)
    acc, prepared = _prepare(backend, plugin, hardware, converted_from)
    x = torch.randn(32, next(plain.parameters()).shape[-1], device=acc.device)
    with torch.no_grad():
        expected = plain.to(acc.device)(x).float()
        got = prepared(x).float()
    error = ((got - expected).norm() / expected.norm()).item()
    assert error <= rtol, f"converted outputs differ from the plain model's by {error:.3f} (relative), more than {rtol}"
    return error


def check_autocast_nests_with_bf16(backend: str, plugin: object | None = None, hardware: HardwareInfo | None = None,
                                   model_factory: Callable[[], Any] = default_model_factory) -> None:
    """Inside a prepared model's forward, native bf16 autocast is on (the backend's context nests in it)."""
    import torch

    acc, prepared = _prepare(backend, plugin, hardware, model_factory())
    seen = []
    inner = next(m for m in prepared.modules() if m is not prepared)
    inner.register_forward_pre_hook(lambda m, args: seen.append((torch.is_autocast_enabled(acc.device.type), torch.get_autocast_dtype(acc.device.type))))
    prepared(torch.randn(4, next(prepared.parameters()).shape[-1], device=acc.device))
    assert seen and seen[0] == (True, torch.bfloat16), f"forward ran with autocast state {seen[:1]}, expected bf16 autocast"


def check_save_model_is_portable(backend: str, tmp_path: Path, plugin: object | None = None, hardware: HardwareInfo | None = None,
                                 model_factory: Callable[[], Any] = default_model_factory) -> None:
    """``save_model`` writes a file the plain, unconverted model loads strictly, with the same values."""
    import torch
    from safetensors.torch import load_file as safetensors_load

    source = model_factory()
    acc, prepared = _prepare(backend, plugin, hardware, copy.deepcopy(source))
    path = acc.save_model(prepared, tmp_path)
    state = safetensors_load(path)
    plain = model_factory()
    plain.load_state_dict(state)  # strict: every name present, none extra
    for name, value in source.state_dict().items():
        assert torch.allclose(plain.state_dict()[name].float(), value.float(), atol=1e-2), f"{name} changed in save_model"


def run_conformance(backend: str, *, entry_point: str | None = None, heavy_modules: tuple[str, ...] = (),
                    plugin: object | None = None, hardware: HardwareInfo | None = None,
                    model_factory: Callable[[], Any] = default_model_factory, tmp_path: Path | None = None) -> None:
    """Run every check; ``entry_point`` (default: ``backend``) names the plugin's entry point for the
    discovery check, which is skipped for a ``plugin`` object passed directly."""
    description = check_description(backend, plugin, hardware)
    assert description.available, f"{backend!r} is not available here ({description.reason}); run conformance where it is"
    if plugin is None:
        check_discovery_is_cheap(entry_point or backend, heavy_modules)
    check_conversion_keeps_outputs_close(backend, plugin, hardware, model_factory)
    check_autocast_nests_with_bf16(backend, plugin, hardware, model_factory)
    with tempfile.TemporaryDirectory() as tmp:
        check_save_model_is_portable(backend, Path(tmp_path or tmp), plugin, hardware, model_factory)
