"""The README's "What lowbit guarantees" table stays honest: every test a row names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def guarantee_rows() -> list[tuple[str, list[tuple[str, str | None]]]]:
    """(row's 'when' cell, [(test file, test function or None)]) for each row of the table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## What lowbit guarantees", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| when") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        refs, current = [], None
        for ref in re.findall(r"`([^`]*(?:\.py|::test_\w+)[^`]*)`", cells[-1]):
            path, _, name = ref.partition("::")
            if path:
                current = path
            refs.append((current, name or None))
        rows.append((cells[0], refs))
    return rows


def test_every_guarantee_names_tests_that_exist():
    rows = guarantee_rows()
    assert len(rows) >= 15
    for when, refs in rows:
        assert refs, f"row without a test: {when}"
        for path, name in refs:
            # a file under tests/ or tests/core/<subpackage>/ (test file names are unique)
            found = sorted((ROOT / "tests").rglob(path))
            assert found, f"{when}: {path} does not exist"
            file = found[0]
            if name:
                functions = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
                assert name in functions, f"{when}: {path}::{name} does not exist"
