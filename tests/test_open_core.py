"""The open core: it names no plugin. What it needs to know about a backend or a strategy comes from
the plugin's own description (BackendDescription, StrategyTraits), the built-in plugins included.

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
    "utils.py": "Accelerate's lowbit.utils names (TERecipeKwargs, is_deepspeed_available, ...)",
    "cli/flags.py": "Accelerate's launch flags (--use_fsdp, --use_deepspeed, --fsdp_*, --fp8_opt_level)",
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


def test_no_core_module_imports_one_that_imports_it_back():
    graph = import_graph()
    pairs = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph[b]})
    assert not pairs, f"import circles: {pairs}"


# Private names of other libraries' objects that lowbit has to touch, each for a reason.
FOREIGN_PRIVATE = {
    "_cdata": "a torch storage's identity (meta tensors have no data pointer to compare)",
    "_actions": "argparse: the flags a parser defines (did-you-mean for a misspelt one)",
    "_SubParsersAction": "argparse: the subcommands of a parser",
    "_dynamo": "torch._dynamo.list_backends",
    "_orig_mod": "torch.compile's wrapper",
    "_step_count": "torch LR schedulers (OneCycleLR's end)",
    "_wrapped_by_lr_sched": "torch's LRScheduler step marker",
    "_opt_called": "torch's LRScheduler step marker",
    "_option_string_actions": "argparse: a flag already defined",
    "_exit": "os._exit at a failed rank's exit",
    "_shared": "PartialState's own class state",
    "_reset_state": "PartialState's own class method",
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
