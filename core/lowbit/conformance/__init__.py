"""The conformance kit: checks a backend plugin runs in its own test suite to prove it keeps the
lowbit contract, by training with it.

    from lowbit.conformance import run_conformance

    def test_my_backend_honours_the_lowbit_contract(tmp_path):
        run_conformance("mybackend", heavy_modules=("my_fp8_lib",), tmp_path=tmp_path)

``run_conformance`` finds the backend through its entry point, as users' runs do. Each check is
also a function of its own (``check_*``), and each failure is a ``ConformanceFailure`` (an
``AssertionError``) whose message names the backend, the hook and what was expected. The backend
must be available where the tests run; pass ``hardware=`` to test it on a stand-in, and
``plugin=`` only for a plugin object that is not installed (that skips the discovery check).
What is checked, with which inputs and tolerances: docs/writing-a-backend.md, section 5.

A distributed strategy runs ``run_strategy_conformance("mystrategy", tmp_path=tmp_path)``: it
trains under ``lowbit launch`` in 2 processes and against one process (:mod:`lowbit.conformance.strategy`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from lowbit.conformance.discovery import backend_library_modules, check_description, check_discovery_is_cheap
from lowbit.conformance.setup import ConformanceFailure, default_model_factory
from lowbit.conformance.strategy import run_strategy_conformance
from lowbit.conformance.training import (
    check_autocast_nests_with_bf16,
    check_conversion_keeps_outputs_close,
    check_conversion_keeps_weights,
    check_layers_converted,
    check_odd_sizes,
    check_resume,
    check_save_model_is_portable,
    check_training,
)

from lowbit.kernel.types import HardwareInfo

__all__ = [
    "backend_library_modules",
    "ConformanceFailure",
    "default_model_factory",
    "run_conformance",
    "run_strategy_conformance",
    "check_description",
    "check_discovery_is_cheap",
    "check_layers_converted",
    "check_conversion_keeps_weights",
    "check_conversion_keeps_outputs_close",
    "check_autocast_nests_with_bf16",
    "check_training",
    "check_odd_sizes",
    "check_resume",
    "check_save_model_is_portable",
]


def run_conformance(
    backend: str,
    *,
    entry_point: str | None = None,
    heavy_modules: tuple[str, ...] = (),
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
    tmp_path: Path | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run every check. ``entry_point`` (default: ``backend``) names the plugin's entry point for the
    discovery check; ``heavy_modules`` are added to torch and the known backend libraries, none of
    which discovery may import. Returns what was measured (layers converted, losses, errors)."""
    say = print if verbose else (lambda *_: None)
    description = check_description(backend, plugin, hardware)
    if not description.available:
        raise ConformanceFailure(
            f"{backend}: describe_backend: not available here ({description.reason}); "
            "run the conformance kit where the backend can run (or pass hardware=)"
        )
    if plugin is None:
        check_discovery_is_cheap(entry_point or backend, heavy_modules)
        say(f"{backend}: discovery imports nothing heavy")
    report: dict[str, Any] = {"converted": check_layers_converted(backend, plugin, hardware, model_factory)}
    say(f"{backend}: converted {report['converted']}")
    report["weight_change"] = check_conversion_keeps_weights(backend, plugin, hardware, model_factory)
    check_odd_sizes(backend, plugin, hardware, model_factory)  # before any check that feeds a batch of its own
    report["output_error"] = check_conversion_keeps_outputs_close(backend, plugin, hardware, model_factory)
    check_autocast_nests_with_bf16(backend, plugin, hardware, model_factory)
    report["losses"] = check_training(backend, plugin, hardware, model_factory)
    say(f"{backend}: trained, losses {[round(x, 4) for x in report['losses']]}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp_path or tmp)
        check_resume(backend, root / "resume", plugin, hardware, model_factory)
        check_save_model_is_portable(backend, root / "model", plugin, hardware, model_factory)
    say(f"{backend}: odd sizes, resume and save_model pass")
    return report
