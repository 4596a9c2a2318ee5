"""Code CI cannot run (GPU tests, the scripts they launch, benchmarks) is still read by a linter,
and every script a test launches is a file the linter sees, not a string literal."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ("core", "plugins", "tests", "bench", "examples")
# Where a test or benchmark could hide a script: everything that launches code lives here.
SCRIPT_HOMES = ("tests", "bench")


def test_the_code_passes_ruff():
    """pyflakes' rules and syntax errors (pyproject's [tool.ruff]); a NameError in a GPU-only script
    once made a GPU test fail on every GPU while CPU CI stayed green."""
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.fail("ruff is not installed: `pip install -e \".[test]\"` installs it (lowbit's test extras)")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", *LINTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# Every linted folder is formatted by ruff format (pyproject's [tool.ruff.format]).
FORMATTED = ("core", "plugins", "tests", "bench", "examples")


def test_the_formatted_layers_stay_formatted():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *FORMATTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        "run `ruff format " + " ".join(FORMATTED) + "`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    )


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            found.add(id(body[0].value))
    return found


def _parse(text: str) -> ast.AST | None:
    """The text as Python, or as a ``str.format`` template of Python ({name} fields filled in)."""
    for candidate in (
        text,
        re.sub(r"\{[A-Za-z_]\w*(![rsa])?(:[^{}]*)?\}", "0", text).replace("{{", "{").replace("}}", "}"),
    ):
        try:
            return ast.parse(candidate)
        except SyntaxError:
            continue
    return None


def scripts_in_string_literals(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Each string literal (docstrings aside) that is a Python program importing something, as
    'file:line': code no linter reads and, when only a GPU launches it, nothing runs."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
                continue
            if "import" not in node.value:
                continue
            code = _parse(textwrap.dedent(node.value))
            if code is not None and any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(code)):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_script_lives_in_a_string_literal():
    paths = sorted(p for home in SCRIPT_HOMES for p in (ROOT / home).rglob("*.py"))
    found = scripts_in_string_literals(paths)
    assert not found, (
        "move these scripts into files (tests/scripts/, or beside the test that launches them), "
        "so the linter reads them and CPU CI can run them: " + ", ".join(found)
    )


def test_the_script_finder_finds_a_script_and_passes_prose(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_bytes(
        b'"""Docstring: import what you need."""\nA = "import os\\nprint(os.sep)"\n'
        b'B = "the import failed"\nC = "x = 1"\nD = "import sys\\nsys.exit({code!r})"\n'
    )
    assert scripts_in_string_literals([sample], root=tmp_path) == ["sample.py:2", "sample.py:5"]
