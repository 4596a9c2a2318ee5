"""The open core: it names no plugin. What it needs to know about a backend or a strategy comes from
the plugin's own description (BackendDescription, StrategyDescription), the built-in plugins included.

Allowed to name plugins: the built-in plugins themselves (``lowbit/builtin/``), and the modules
that map Accelerate's own names (its fp8_backend values, distributed types, config keys, launch
flags, handler classes and utils), listed below with the reason.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core" / "lowbit"
# Module -> why it may name plugins: it maps Accelerate's names onto lowbit's.
ACCELERATE_NAME_MODULES = {
    "compat/accelerate_names.py": "Accelerate's fp8_backend values and distributed types",
    "compat/accelerate_config.py": "Accelerate's config file keys (fsdp_*, deepspeed_*)",
    "compat/handlers.py": "Accelerate's handler and plugin classes (FullyShardedDataParallelPlugin, DeepSpeedPlugin)",
    "utils/dataclasses.py": "Accelerate's recipe classes by plugin (TERecipeKwargs, AORecipeKwargs, ...)",
    "utils/imports.py": "Accelerate's is_<library>_available names (is_deepspeed_available, ...)",
    "cli/flags.py": "Accelerate's launch flags (--use_fsdp, --use_deepspeed, --fsdp_*, --fp8_opt_level)",
    "test_utils/testing.py": "Accelerate's require_<library> test decorators (require_deepspeed, require_torchao, ...)",
    "utils/refused.py": "Accelerate's utils for jobs a plugin does inside prepare (fsdp2_*, TE's convert_model)",
    "utils/deepspeed.py": "Accelerate's accelerate.utils.deepspeed names (DummyOptim, ...)",
    "utils/modeling.py": "Accelerate's has_transformer_engine_layers",
    "utils/other.py": "Accelerate's get_active_deepspeed_plugin and its state's deepspeed_plugin",
}
PLUGIN_NAMES = ("te", "ao", "msamp", "ms-amp", "deepspeed", "fsdp", "fsdp2", "ddp", "torchao", "transformer_engine",
                "transformer-engine", "lowbit-te", "lowbit-ao", "lowbit-msamp", "lowbit-deepspeed")
WORD = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, PLUGIN_NAMES)) + r")(?![A-Za-z0-9])", re.IGNORECASE)


def plugin_names_in_code(path: Path) -> list[str]:
    """String literals of ``path`` (docstrings aside) that name a plugin, as 'line: text'."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [f"{node.lineno}: {node.value[:80]!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and WORD.search(node.value)]


def core_modules() -> list[Path]:
    return [p for p in sorted(CORE.rglob("*.py"))
            if "builtin" not in p.relative_to(CORE).parts and p.relative_to(CORE).as_posix() not in ACCELERATE_NAME_MODULES]


def test_no_core_module_names_a_plugin():
    offenders = {p.relative_to(CORE).as_posix(): found for p in core_modules() if (found := plugin_names_in_code(p))}
    assert not offenders, ("these core modules name plugins; ask the plugin's description instead "
                           f"(or, for Accelerate's own names, map them in accelerate_names.py): {offenders}")


def test_the_check_sees_a_plugin_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""The docstring may say deepspeed."""\nSTRATEGY = {"DEEPSPEED": "deepspeed"}\nNOTE = "non-zero, often"\n')
    assert [line.split(":")[0] for line in plugin_names_in_code(planted)] == ["2", "2"]


def test_the_allowed_modules_exist_and_say_why():
    for module, why in ACCELERATE_NAME_MODULES.items():
        assert (CORE / module).is_file() and why, module


# ---------------------------------------------------------------------- the knot is untied


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Core module -> the core modules it imports (at any depth of the file, TYPE_CHECKING included);
    ``from lowbit import checkpoint`` counts as importing ``lowbit.checkpoint.files``, not the package."""
    modules = {_module_name(p): p for p in CORE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lowbit":
                submodules = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                deps |= submodules or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "lowbit"}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The loops of ``graph`` of any length: its strongly connected components of two or more
    nodes (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
    return sorted(loops)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same imports between folders: a subpackage (its ``__init__`` included) is one node,
    each top-level module of ``lowbit`` its own."""
    def node(module: str) -> str:
        parts = module.split(".")
        if len(parts) == 1:
            return module  # the lowbit package's own __init__
        return parts[1] if len(parts) > 2 or CORE.joinpath(*parts[1:]).is_dir() else module

    folders: dict[str, set[str]] = {}
    for module, imported in graph.items():
        folders.setdefault(node(module), set()).update(node(m) for m in imported if node(m) != node(module))
    return folders


def test_no_import_loop_of_any_length_between_core_modules():
    assert import_loops(import_graph()) == []


def test_no_import_loop_between_core_folders():
    """A subpackage is one node: config/ -> plugins/ -> config/ is a loop even when no file imports
    one that imports it back."""
    assert import_loops(folder_graph(import_graph())) == []


def test_config_imports_only_what_lies_below_it():
    """config/ (settings, option specs, the recipe vocabulary) reads Accelerate's names from compat/
    and plain records from the top-level leaf modules; it never asks the plugins."""
    below = {"compat", "lowbit.types", "lowbit.errors", "lowbit.notices", "lowbit.hookspecs", "lowbit.atomic_write", "config",
             "lowbit.collective_device"}  # a leaf: the NCCL simulation's variable is named there
    assert folder_graph(import_graph())["config"] <= below


def test_the_loop_finder_finds_long_loops_and_only_loops():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}}
    assert import_loops(graph) == [["a", "b", "c"]]


# Private names of other libraries' objects that lowbit has to touch, each for a reason.
FOREIGN_PRIVATE = {
    "_cdata": "a torch storage's identity (meta tensors have no data pointer to compare)",
    "_actions": "argparse: the flags a parser defines (did-you-mean for a misspelt one)",
    "_SubParsersAction": "argparse: the subcommands of a parser",
    "_dynamo": "torch._dynamo.list_backends",
    "_orig_mod": "torch.compile's wrapper",
    "_modules": "a module's child table: compile_regions gives the twin its own (copy.copy would share it)",
    "_step_count": "torch LR schedulers (OneCycleLR's end)",
    "_wrapped_by_lr_sched": "torch's LRScheduler step marker",
    "_opt_called": "torch's LRScheduler step marker",
    "_option_string_actions": "argparse: a flag already defined",
    "_exit": "os._exit at a failed rank's exit",
    "_shared": "PartialState's own class state",
    "_reset_state": "PartialState's own class method",
    "_flatten": "torch's DeviceMesh: the only way to name a joint dimension (dp, dp_shard_cp)",
}


def test_collaborators_read_no_private_member_of_another_object():
    """``acc._models``, ``acc._call`` and the like: a collaborator gets what it needs instead."""
    found = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith(("__", "_lowbit"))
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr not in FOREIGN_PRIVATE):
                found.append(f"{path.relative_to(CORE)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
