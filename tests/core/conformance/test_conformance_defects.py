"""The conformance kit catches the defects that ruin a training run silently: each is planted,
one at a time, into a small working backend, and run_conformance must fail naming the problem."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import install_entry_points, install_plugin_module
from torch import nn
from torch.nn import functional as F

from lowbit import Accelerator, hookimpl
from lowbit.conformance import ConformanceFailure, check_discovery_is_cheap, run_conformance

from lowbit.kernel.errors import PluginError
from lowbit.kernel.recipes import FP8RecipeKwargs
from lowbit.kernel.types import BackendDescription

E4M3_MAX = 448.0


def e4m3(weight: torch.Tensor) -> torch.Tensor:
    scale = E4M3_MAX / weight.detach().abs().amax().clamp(min=1e-12)
    return (weight * scale).to(torch.float8_e4m3fn).to(weight.dtype) / scale


class TinyFP8Linear(nn.Linear):
    """FP8 (e4m3) weights in the forward, gradients straight through; ``defect`` breaks it on purpose."""

    defect: str | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, defect: str | None) -> "TinyFP8Linear":
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias, new.defect = linear.weight, linear.bias, defect
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.defect == "needs_multiple_of_32_tokens" and (x.numel() // x.shape[-1]) % 32:
            raise RuntimeError(f"kernel needs a multiple of 32 tokens, got {x.numel() // x.shape[-1]}")
        weight = self.weight.detach() if self.defect == "detaches_weight" else self.weight
        return F.linear(x, weight + (e4m3(weight) - weight).detach(), self.bias)


class TinyFP8:
    """A working FP8 backend, or one with a single planted ``defect``."""

    def __init__(self, defect: str | None = None):
        self.defect = defect

    @hookimpl
    def describe_backend(self, hardware):
        return BackendDescription("tinyfp8", 10, available=True)

    @hookimpl
    def convert_model(self, model, context):
        target = copy.deepcopy(model) if self.defect == "returns_none" else model  # converts a copy, returns nothing
        for parent in list(target.modules()):
            for name, child in list(parent.named_children()):
                eligible = type(child) is nn.Linear and (
                    self.defect != "filter_takes_nothing" or child.in_features > 10**6
                )
                if eligible:
                    if self.defect == "rounds_weights_in_place":
                        with torch.no_grad():
                            child.weight.copy_(e4m3(child.weight))
                    setattr(parent, name, TinyFP8Linear.from_linear(child, self.defect))
        return None if self.defect == "returns_none" else model

    @hookimpl
    def autocast_context(self, model, context):
        import contextlib

        return 42 if self.defect == "autocast_returns_42" else contextlib.nullcontext


def test_the_working_backend_passes(tmp_path):
    report = run_conformance("tinyfp8", plugin=TinyFP8(), tmp_path=tmp_path)
    assert report["converted"] == ["0", "2", "4", "6"] and report["weight_change"] == 0.0
    assert report["losses"][-1] < 0.9 * report["losses"][0]


@pytest.mark.parametrize(
    "defect, message",
    [
        ("returns_none", r"tinyfp8: convert_model: no layer was converted: all 4 Linear layers"),
        ("filter_takes_nothing", r"tinyfp8: convert_model: no layer was converted"),
        (
            "rounds_weights_in_place",
            r"tinyfp8: convert_model: conversion changed 0.weight by up to 0.00\d+; expected the weights bit for bit",
        ),
        ("detaches_weight", r"tinyfp8: convert_model: after backward, 0.weight: no gradient; 2.weight: no gradient"),
        (
            "needs_multiple_of_32_tokens",
            r"tinyfp8: convert_model: the converted model fails on an input of shape \(1, 64\): "
            r"RuntimeError: kernel needs a multiple of 32 tokens",
        ),
    ],
)
def test_a_planted_defect_fails_the_kit_naming_it(tmp_path, defect, message):
    with pytest.raises(ConformanceFailure, match=message):
        run_conformance("tinyfp8", plugin=TinyFP8(defect), tmp_path=tmp_path)


def test_a_module_level_torch_import_fails_discovery(tmp_path, monkeypatch):
    """The call the docs show (no heavy_modules) catches it: torch is always on the list."""
    install_plugin_module(tmp_path, "lowbit_eager_fp8")
    install_entry_points(tmp_path, "lowbit-eager", "0.1", {"eager": "lowbit_eager_fp8"})
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(ConformanceFailure, match=r"eager: discovery .* imported \['torch'\]"):
        check_discovery_is_cheap("eager")


def test_an_autocast_context_that_is_not_a_context_manager_fails_at_prepare():
    from lowbit.run.plugin_manager import make_plugin_manager

    acc = Accelerator(
        mixed_precision="fp8",
        kwargs_handlers=[FP8RecipeKwargs(backend="tinyfp8")],
        plugin_manager=make_plugin_manager(extra_plugins=[TinyFP8("autocast_returns_42")]),
    )
    with pytest.raises(
        PluginError,
        match=r"low-precision backend 'tinyfp8'.*autocast_context returned int 42, expected a function of no "
        r"arguments that returns a context manager",
    ):
        acc.prepare(nn.Sequential(nn.Linear(16, 16)))


def test_a_convert_model_that_returns_something_else_fails_at_prepare():
    class ReturnsDict(TinyFP8):
        @hookimpl
        def convert_model(self, model, context):
            return {"model": model}

    from lowbit.run.plugin_manager import make_plugin_manager

    acc = Accelerator(
        mixed_precision="fp8",
        kwargs_handlers=[FP8RecipeKwargs(backend="tinyfp8")],
        plugin_manager=make_plugin_manager(extra_plugins=[ReturnsDict()]),
    )
    with pytest.raises(
        PluginError, match=r"low-precision backend 'tinyfp8'.*convert_model returned dict, expected a torch.nn.Module"
    ):
        acc.prepare(nn.Sequential(nn.Linear(16, 16)))
