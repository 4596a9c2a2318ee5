"""Meta-test: every hook in the contract is documented, explained, implemented and tested."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from lowbit.kernel import hookspecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = sorted(name for name, fn in vars(hookspecs).items() if inspect.isfunction(fn) and hasattr(fn, "lowbit_spec"))
PLUGIN_SOURCES = "\n".join(
    p.read_text() for p in [*ROOT.glob("core/lowbit/runtime/builtin/*.py"), *ROOT.glob("plugins/*/*/__init__.py")]
)
TEST_SOURCES = "\n".join(p.read_text() for p in ROOT.glob("tests/**/*.py") if p.name != "test_hookspecs.py")
DOCS = (ROOT / "docs" / "writing-a-backend.md").read_text()


def test_there_are_hooks():
    assert {"detect_hardware", "describe_backend", "convert_model", "wrap_optimizer", "autocast_context"} <= set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_docstring_says_who_calls_it(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert "Called by:" in doc and "Return" in doc, f"{hook}: say who calls it and what it returns"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_for_plugin_authors(hook):
    assert f"`{hook}(" in DOCS or f"`{hook}`" in DOCS, f"{hook} is missing from docs/writing-a-backend.md"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_implemented_by_a_shipped_plugin(hook):
    assert f"def {hook}(" in PLUGIN_SOURCES, f"no plugin in this repository implements {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_named_in_a_test(hook):
    assert hook in TEST_SOURCES, f"no test mentions {hook}"
