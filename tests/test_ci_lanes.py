"""The torch versions CI tests under are the ones lowbit names (``lowbit env``, the README) and the
floor every distribution declares."""

from __future__ import annotations

import re
from pathlib import Path

from lowbit.kernel.version import TESTED_TORCH

ROOT = Path(__file__).resolve().parents[1]


def test_ci_installs_each_tested_torch_and_every_distribution_declares_the_oldest_as_its_floor():
    ci = (ROOT / ".ci" / "run").read_text()
    assert sorted(re.findall(r"torch==([\d.]+)", ci)) == sorted(TESTED_TORCH)
    oldest = min(TESTED_TORCH, key=lambda v: tuple(int(p) for p in v.split(".")))
    floor = ".".join(oldest.split(".")[:2])
    for pyproject in [ROOT / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]:
        dependencies = re.search(r"^dependencies = \[(.*)\]", pyproject.read_text(), re.M).group(1)
        assert f'"torch>={floor}"' in dependencies, pyproject


def test_the_readme_names_the_tested_versions():
    readme = (ROOT / "README.md").read_text()
    for version in TESTED_TORCH:
        assert f"torch {version}" in readme, version
