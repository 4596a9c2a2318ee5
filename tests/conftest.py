"""Shared fixtures: every test runs with a clean lowbit environment and its own config dir."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def clean_lowbit_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("LOWBIT_"):
            monkeypatch.delenv(key)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    # Processes a test starts hold lowbit's collectives to NCCL's device rule (collective_device.py).
    monkeypatch.setenv("LOWBIT_SIMULATE_NCCL", "1")
    yield


@pytest.fixture(autouse=True)
def _each_test_hears_lowbits_notices():
    """lowbit says each notice once per process; every test is a fresh run as far as notices go."""
    from lowbit.kernel import notices

    notices.reset()
    yield


# ---------------------------------------------------------------------- where the time goes

_SECONDS_PER_FILE: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown, summed per file (.ci/run's budgets read the summary)."""
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_PER_FILE[path] = _SECONDS_PER_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS_PER_FILE:
        return
    total = sum(_SECONDS_PER_FILE.values())
    slowest = sorted(_SECONDS_PER_FILE.items(), key=lambda item: -item[1])[:12]
    terminalreporter.write_sep("=", f"slowest test files ({total:,.0f} s in all)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:4.1f}%  {path}")
