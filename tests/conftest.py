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
