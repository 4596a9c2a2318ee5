"""lowbit.conformance: the conformance suite passes for real backends and fails for broken ones."""

from __future__ import annotations

import os

import pytest
from helpers import ROOT, FakeBackend, install_entry_points, install_plugin_module

from lowbit import hookimpl
from lowbit.conformance import (
    check_autocast_nests_with_bf16,
    check_description,
    check_discovery_is_cheap,
    run_conformance,
)

from lowbit.kernel.types import BackendDescription


def test_the_ao_backend_passes(tmp_path):
    pytest.importorskip("lowbit_ao")
    run_conformance("ao", heavy_modules=("torchao",), tmp_path=tmp_path)


def test_the_documented_third_party_backend_passes_through_its_entry_point(tmp_path, monkeypatch):
    """As installed by `pip install -e examples/third_party_backend`: a dist-info with its entry
    point, so discovery (and the discovery check) find it the way users' runs do."""
    install_entry_points(tmp_path, "lowbit-fakefp8", "0.1.0", {"fakefp8": "lowbit_fakefp8"})
    example = ROOT / "examples" / "third_party_backend"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(example))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(example)]))
    report = run_conformance("fakefp8", tmp_path=tmp_path / "work")
    assert report["converted"] and report["weight_change"] == 0.0


def test_a_backend_without_a_reason_fails():
    class Silent:
        @hookimpl
        def describe_backend(self, hardware):
            return BackendDescription("silent", 10, available=False, reason="")

    with pytest.raises(AssertionError, match="must say why"):
        check_description("silent", plugin=Silent())


def test_a_backend_that_breaks_nesting_fails():
    class NoAutocast(FakeBackend):
        @hookimpl
        def autocast_context(self, model, context):
            import torch

            return lambda: torch.autocast("cpu", enabled=False)  # switches the outer bf16 autocast off

    with pytest.raises(AssertionError, match="expected bf16 autocast"):
        check_autocast_nests_with_bf16("rude", plugin=NoAutocast("rude", 400))


def test_heavy_import_at_discovery_fails(tmp_path, monkeypatch):
    install_plugin_module(tmp_path, "lowbit_heavy_fp8")
    install_plugin_module(tmp_path, "json_heavy_stand_in")
    install_entry_points(tmp_path, "lowbit-heavy", "0.1", {"heavy": "lowbit_heavy_fp8"})
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(AssertionError, match=r"imported \['json_heavy_stand_in'\]"):
        check_discovery_is_cheap("heavy", heavy_modules=("json_heavy_stand_in",))
