"""The Accelerator only translates: each of its methods and properties hands Accelerate's call to
the run (``lowbit.run.training_run.TrainingRun``) in at most three statements, counted with every
nested statement, the docstring left out. lowbit's rules (what is refused, what is reported, what
is written) live in the run or in ``runtime/``, where the other fronts reach them too. A method
that needs more names its reason in ``LONGER_HANDOFFS``, which holds only methods that need it.
The same shape as ``tests/test_open_core.py``'s allow-list: effort alone did not hold this line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FACADE = Path(__file__).resolve().parents[3] / "core" / "lowbit" / "compat" / "accelerator.py"
MOST_STATEMENTS = 3

# Method -> why it is more than a handoff. Each reason must be Accelerate's, not lowbit's.
LONGER_HANDOFFS = {
    "__init__": "translates Accelerate's arguments and handler objects (its own or Accelerate's) into a RunRequest",
    "prepare_model": "Accelerate's device_placement and evaluation_mode arguments, read as the run's two ways in",
    "prepare_data_loader": "Accelerate's slice_fn_for_dispatch argument, set on the loader the run prepared",
    "profile": "two forms: Accelerate's own (ProfileKwargs) and lowbit's scheduled profile, told apart by argument",
    "check_trigger": "Accelerate's flag_tensor is a public attribute of the Accelerator, read and reset here",
}

# Modules whose rules belong to the run: the facade reaches them only through it.
RUN_ONLY_MODULES = (
    "lowbit.runtime.checkpoint",  # the checkpoint refusals, model files, automatic names
    "lowbit.runtime.observe.fp8_report",
    "lowbit.runtime.observe.fp8_payoff",
)


def _accelerator_class() -> ast.ClassDef:
    tree = ast.parse(FACADE.read_text())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Accelerator")


def statements(function: ast.FunctionDef) -> int:
    """Every statement in ``function``'s body, nested ones included, its docstring left out."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return sum(1 for statement in body for node in ast.walk(statement) if isinstance(node, ast.stmt))


def methods() -> dict[str, int]:
    """Statements per method and property of the Accelerator (a setter counted under its name + '.setter')."""
    counted: dict[str, int] = {}
    for node in _accelerator_class().body:
        if isinstance(node, ast.FunctionDef):
            setter = any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in node.decorator_list)
            counted[node.name + (".setter" if setter else "")] = statements(node)
    return counted


def test_every_accelerator_method_hands_off_in_at_most_three_statements():
    longer = {name: n for name, n in methods().items() if n > MOST_STATEMENTS and name not in LONGER_HANDOFFS}
    assert not longer, (
        f"These Accelerator methods hold more than a handoff ({MOST_STATEMENTS} statements): {longer}. Move the rule "
        "into TrainingRun (or a function in runtime/ the run calls), or name Accelerate's reason in LONGER_HANDOFFS."
    )


def test_the_allow_list_holds_only_methods_that_need_it():
    counted = methods()
    stale = {name for name in LONGER_HANDOFFS if counted.get(name, 0) <= MOST_STATEMENTS}
    assert not stale, f"LONGER_HANDOFFS names methods that are gone or are handoffs now: {sorted(stale)}"


def test_the_facade_reaches_the_checkpoint_and_fp8_report_rules_only_through_the_run():
    imported = set()
    for node in ast.walk(ast.parse(FACADE.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    reached = sorted(m for m in imported if any(m == r or m.startswith(r + ".") for r in RUN_ONLY_MODULES))
    assert not reached, f"compat/accelerator.py imports {reached}: hand the call to the run instead."


@pytest.mark.parametrize("name", ["facts", "context", "plugins", "prepared", "step_state", "counters"])
def test_the_runs_parts_are_not_the_accelerators_attributes(name):
    """Undocumented pass-throughs are gone: the run's parts are the run's (``accelerator._run``)."""
    from lowbit import Accelerator

    assert not hasattr(Accelerator, name)


def test_the_count_counts_nested_statements():
    """The counter is the rule: a method with an if and a raise inside is three statements, not one."""
    function = ast.parse("def f(x):\n    '''doc'''\n    if x:\n        raise ValueError\n    return x\n").body[0]
    assert statements(function) == 3
