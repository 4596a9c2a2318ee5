"""The core's layers (kernel, runtime, run, compat, top), checked on its import statements (every
one: module level, inside functions and under TYPE_CHECKING), and every module named in a string
(``importlib.import_module("lowbit....")``, a constant holding a module path): a module loaded by
name is an import the layers see.

    kernel   (lowbit/kernel/)    imports only the kernel
    runtime  (lowbit/runtime/)   the kernel and itself
    run      (lowbit/run/)       the kernel, the runtime and itself: lowbit's settings, plugin choice,
                                 layout, TrainingRun
    compat   (lowbit/compat/)    the layers below and itself
    top                          the command line (lowbit/cli/), the conformance kit
                                 (lowbit/conformance/), Accelerate's test kit (lowbit/test_utils/),
                                 other libraries' ways in (lowbit/integrations/: transformers' Trainer
                                 and TRL) and Accelerate's module paths (lowbit/state.py, lowbit/utils/, ...)

``import lowbit`` loads the kernel only; its public names load lazily. A first-party plugin
imports ``lowbit`` (for ``hookimpl``) and the kernel only. No import loop, of files or of folders.
docs/architecture.md says what goes where.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
PACKAGE = CORE / "lowbit"
PLUGINS = ROOT / "plugins"

LAYERS = ("kernel", "runtime", "run", "compat", "top")
# A folder of the package -> its layer; a module outside these folders is one of Accelerate's paths (top).
FOLDER_LAYER = {
    "kernel": "kernel",
    "runtime": "runtime",
    "run": "run",
    "compat": "compat",
    "cli": "top",
    "conformance": "top",
    "test_utils": "top",
    "integrations": "top",
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str) -> list[tuple[str, int]]:
    """Every ``lowbit`` module ``path`` imports (a name taken from a package counts as its module
    when that module exists), with the line."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found += [(_existing(f"{module}.{alias.name}") or module, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
            found += [(node.value, node.lineno)] if _existing(node.value) else []
    return [(m, line) for m, line in found if m == "lowbit" or m.startswith("lowbit.")]


# A string that is a module path of the core ("lowbit.runtime.builtin.ddp"): loaded by name somewhere.
MODULE_PATH = re.compile(r"lowbit(\.[a-z_][a-z0-9_]*)+")


def _existing(module: str) -> str | None:
    path = CORE / module.replace(".", "/")
    return module if path.with_suffix(".py").exists() or (path / "__init__.py").exists() else None


def layer_of(module: str) -> str:
    parts = module.split(".")
    return FOLDER_LAYER.get(parts[1], "top") if len(parts) > 1 else "top"


def core_modules() -> dict[str, Path]:
    return {module_name(p, CORE): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    modules = core_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, _ in imported_modules(path, name):
            while module not in modules:  # ``lowbit.kernel.types.X`` -> ``lowbit.kernel.types``
                module = module.rpartition(".")[0]
            if module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def test_every_import_of_the_core_follows_the_layer_order():
    against = []
    for name, path in core_modules().items():
        mine = LAYERS.index(layer_of(name))
        for module, line in imported_modules(path, name):
            if LAYERS.index(layer_of(module)) > mine:
                against.append(
                    f"{path.relative_to(ROOT)}:{line} ({layer_of(name)}) imports {module} ({layer_of(module)})"
                )
    assert not against, "imports against the layer order:\n" + "\n".join(against)


def modules_loaded(which: str) -> dict:
    """What ``tests/scripts/modules_loaded.py which`` reports: the lowbit modules that import loads, and torch."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "modules_loaded.py"), which],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def test_importing_lowbit_loads_only_the_kernel_and_no_torch():
    loaded = modules_loaded("root")
    ours = [m for m in loaded["lowbit"] if m != "lowbit"]
    assert ours and all(layer_of(m) == "kernel" for m in ours) and not loaded["torch"], loaded


def test_building_the_plugin_manager_loads_no_torch():
    """Discovery is cheap: the built-ins and the installed plugins' entry modules, no torch."""
    loaded = modules_loaded("plugin_manager")
    assert "lowbit.runtime.builtin.ddp" in loaded["lowbit"] and not loaded["torch"], loaded


@pytest.mark.parametrize("plugin", sorted(p.name for p in PLUGINS.iterdir() if (p / "pyproject.toml").exists()))
def test_a_first_party_plugin_imports_only_the_kernel(plugin):
    outside = []
    for path in sorted((PLUGINS / plugin).rglob("*.py")):
        if "tests" in path.parts:
            continue
        for module, line in imported_modules(path, module_name(path, PLUGINS / plugin)):
            if module != "lowbit" and layer_of(module) != "kernel":
                outside.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not outside, "a plugin imports lowbit's kernel only (lowbit.kernel.plugin_api):\n" + "\n".join(outside)


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        loops.append(sorted(component))
    return loops


def test_no_import_loop_between_files():
    assert not _loops(import_graph())


def test_no_import_loop_between_folders():
    folders: dict[str, set[str]] = {}
    modules = core_modules()
    for name, targets in import_graph().items():
        folder = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
        for target in targets:
            target_folder = target if modules[target].name == "__init__.py" else target.rpartition(".")[0]
            # A folder importing one of its own subfolders (or the reverse) is one place, not a loop.
            if (
                not (target_folder.startswith(folder + ".") or folder.startswith(target_folder + "."))
                and target_folder != folder
            ):
                folders.setdefault(folder, set()).add(target_folder)
            folders.setdefault(target_folder, set())
        folders.setdefault(folder, set())
    assert not _loops(folders)


def test_the_checks_find_an_import_against_the_order():
    planted = ROOT / "tests" / "fixtures" / "kernel_module_importing_compat.py"
    ((module, line),) = imported_modules(planted, "lowbit.kernel.planted")
    assert (layer_of("lowbit.kernel.planted"), layer_of(module), line) == ("kernel", "compat", 6)
    loaded_by_name = ROOT / "tests" / "fixtures" / "kernel_module_loading_runtime_by_name.py"
    assert [(layer_of(m), line) for m, line in imported_modules(loaded_by_name, "lowbit.kernel.planted")] == [
        ("runtime", 8)
    ]
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


# ---------------------------------------------------------------- Accelerate's module paths on top

ACCELERATE_PATHS = (
    "accelerator",
    "state",
    "hooks",
    "optimizer",
    "scheduler",
    "inference",
    "big_modeling",
    "data_loader",
    "local_sgd",
    "tracking",
    "logging",
    "launchers",
    "parallelism_config",
)
# The paths whose code is lowbit's own run, not the compatibility layer (the layout is the run's).
HELD_IN_RUN = {"parallelism_config": "lowbit.run.layout"}


@pytest.mark.parametrize("path", ACCELERATE_PATHS)
def test_an_accelerate_module_path_is_the_compat_module_itself(path):
    public = importlib.import_module(f"lowbit.{path}")
    assert public is importlib.import_module(HELD_IN_RUN.get(path, f"lowbit.compat.{path}"))
    assert len([line for line in (PACKAGE / f"{path}.py").read_text().splitlines() if line]) <= 3  # a shell, not code


def test_accelerates_utils_paths_are_the_compat_modules_and_load_lazily():
    import lowbit.utils.operations

    assert lowbit.utils.operations is importlib.import_module("lowbit.compat.utils.operations")
    loaded = modules_loaded("set_seed")["lowbit"]
    assert "lowbit.compat.utils.random" in loaded
    assert not [m for m in loaded if m.startswith(("lowbit.runtime", "lowbit.compat.utils.dataclasses"))], loaded


def test_the_conformance_kit_keeps_its_old_path_with_a_deprecation_warning():
    sys.modules.pop("lowbit.testing", None)
    with pytest.warns(DeprecationWarning, match="lowbit.conformance"):
        old = importlib.import_module("lowbit.testing")
    assert old is importlib.import_module("lowbit.conformance") and callable(old.run_conformance)
