"""What every conformance check shares: the plugin manager, a prepared Accelerator, the data."""

from __future__ import annotations

from typing import Any

from lowbit.kernel.manager import LowbitPluginManager
from lowbit.kernel.types import HardwareInfo

from lowbit.run.plugin_manager import make_plugin_manager


class ConformanceFailure(AssertionError):
    """A backend broke the lowbit contract; the message says which hook and what was expected."""


def fail(backend: str, hook: str, problem: str) -> None:
    raise ConformanceFailure(f"{backend}: {hook}: {problem}")


def make_manager(plugin: object | None, hardware: HardwareInfo | None) -> LowbitPluginManager:
    extra: list[object] = [] if plugin is None else [plugin]
    if hardware is not None:
        from lowbit.kernel.hookspecs import hookimpl

        class _Hardware:
            @hookimpl(tryfirst=True)
            def detect_hardware(self, cpu: bool) -> HardwareInfo:
                return hardware

        extra.append(_Hardware())
    return make_plugin_manager(extra_plugins=extra)


def default_model_factory():
    """A small model whose Linears FP8 GEMMs can take (dims multiples of 16): the one ``lowbit test`` trains."""
    from lowbit.cli.self_test import make_model

    return make_model()


def backend_precision(backend: str, manager: LowbitPluginManager) -> str:
    """The precision a low-precision backend trains in (the first it declares: "fp8", "fp4", ...)."""
    from lowbit.run.plugin_manager import registry_for_names

    found = registry_for_names(manager).find("backend", backend)
    return found.description.precisions[0] if found is not None else "fp8"


def prepare(backend: str, plugin: object | None, hardware: HardwareInfo | None, model, lr: float = 1e-3):
    """An Accelerator on ``backend``, in the precision it declares, the prepared model and its
    AdamW (always prepared together: a backend such as MS-AMP converts both at once)."""
    import torch

    from lowbit import Accelerator

    from lowbit.kernel.recipes import FP8RecipeKwargs

    manager = make_manager(plugin, hardware)
    precision = backend_precision(backend, manager)
    acc = Accelerator(
        mixed_precision=precision, kwargs_handlers=[FP8RecipeKwargs(backend=backend)], plugin_manager=manager
    )
    if acc.fp8_backend is None:
        fail(backend, "describe_backend", f"the backend was not chosen for mixed_precision={precision!r}")
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))
    return acc, model, optimizer


def conversion_hook(acc: Any) -> str:
    """The hook that built the FP8 layers: the one to name when they misbehave."""
    both = "prepare_model_and_optimizer"
    return both if acc.run.plugins.converts_model_and_optimizer_together else "convert_model"


def in_features(model) -> int:
    return next(p for p in model.parameters() if p.dim() == 2).shape[-1]


def teacher_data(model, n: int = 128, seed: int = 1):
    """Inputs and targets of a fixed random linear teacher, shaped for ``model``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    features = in_features(model)
    with torch.no_grad():
        out_features = model(torch.zeros(1, features)).shape[-1]
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, out_features, generator=g) / features**0.5
    return x, x @ teacher
