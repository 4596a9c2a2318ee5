"""Transformer Engine's Python sources, read from its wheels with ``ast`` (nothing is imported).

The wheel (about 1 MB, pure Python) is downloaded once per version into
``~/.cache/lowbit-tests``; without network the tests that need it skip and say why.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

CACHE = Path.home() / ".cache" / "lowbit-tests"
# The oldest release lowbit-te accepts (its MIN_TE) and the newest read for this plugin.
SUPPORTED_VERSIONS = ("2.9.0", "2.20.2")


def te_source(version: str) -> Path:
    """The ``transformer_engine`` package folder of that release (skips the test when offline)."""
    cache = CACHE / f"transformer-engine-{version}"
    package = cache / "src" / "transformer_engine"
    if package.exists():
        return package
    cache.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(cache),
                f"transformer-engine=={version}",
            ],
            check=True,
            timeout=900,
            capture_output=True,
            text=True,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(
            f"the transformer-engine {version} wheel could not be downloaded (offline?), so TE's "
            f"sources cannot be read: {(getattr(exc, 'stderr', '') or str(exc)).strip()[-300:]}"
        )
    wheel = next(cache.glob("transformer_engine-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(cache / "src")
    return package


def te_calls(plugin_dir: Path) -> list[tuple[str, int, tuple[str, ...], str]]:
    """Every call lowbit-te makes into ``transformer_engine.pytorch``, read from its source:
    ``te.NAME(...)`` and ``_te_check(te, "NAME")`` (which calls ``NAME(return_reason=True)``),
    as (name, positional count, keyword names, where)."""
    calls = []
    for file in sorted(plugin_dir.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call):
                continue
            where = f"{file.name}:{node.lineno}"
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "te":
                calls.append((func.attr, len(node.args), tuple(k.arg for k in node.keywords if k.arg), where))
            elif isinstance(func, ast.Name) and func.id == "_te_check":
                name = node.args[1]
                assert isinstance(name, ast.Constant), f"{where}: _te_check needs a literal TE function name"
                calls.append((name.value, 0, ("return_reason",), where))
    return calls
