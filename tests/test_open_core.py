"""The open core: it names no plugin. What it needs to know about a backend or a strategy comes from
the plugin's own description (BackendDescription, StrategyDescription), the built-in plugins included.

Allowed to name plugins: the built-in plugins themselves (``lowbit/runtime/builtin/``), and the modules
that map Accelerate's own names (its fp8_backend values, distributed types, config keys, launch
flags, handler classes and utils), listed below with the reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core" / "lowbit"
# Module -> why it may name plugins: it maps Accelerate's names onto lowbit's, or names what lowbit ships.
PLUGIN_NAMING_MODULES = {
    "compat/accelerate_names.py": "Accelerate's fp8_backend values and distributed types",
    "integrations/transformers/training_modules.py": "transformers' training modules by their paths "
    "(transformers.integrations.deepspeed among them)",
    "kernel/first_party.py": "the distributions lowbit publishes, named when one is asked for and absent",
    "utils/deepspeed.py": "Accelerate's path accelerate.utils.deepspeed, an alias of lowbit.compat.utils.deepspeed",
    "utils/fsdp_utils.py": "Accelerate's path accelerate.utils.fsdp_utils, an alias of lowbit.compat.utils.fsdp_utils",
    "compat/utils/constants.py": "Accelerate's FSDP_* constants, under their names in accelerate.utils.constants",
    "compat/utils/__init__.py": "Accelerate's utils submodule paths (accelerate.utils.deepspeed)",
    "run/accelerate_config.py": "Accelerate's config file keys (fsdp_*, deepspeed_*), read as sources of lowbit's "
    "settings",
    "run/layout.py": "ParallelismConfig's sp_backend value (Accelerate's 'deepspeed'), accepted as a name",
    "compat/handlers.py": "Accelerate's handler and plugin classes (FullyShardedDataParallelPlugin, DeepSpeedPlugin)",
    "compat/utils/dataclasses.py": "Accelerate's recipe classes by plugin (TERecipeKwargs, AORecipeKwargs, ...)",
    "compat/utils/imports.py": "Accelerate's is_<library>_available names (is_deepspeed_available, ...)",
    "cli/flags.py": "Accelerate's launch flags (--use_fsdp, --use_deepspeed, --fsdp_*, --fp8_opt_level)",
    "cli/launcher_flags.py": "Accelerate's launch flags that are not settings (--deepspeed_multinode_launcher, the "
    "sequence-parallel ones), each with what lowbit does with it",
    "test_utils/testing.py": "Accelerate's require_<library> test decorators (require_deepspeed, require_torchao, ...)",
    "compat/utils/refused.py": "Accelerate's utils for jobs a plugin does inside prepare (fsdp2_*, TE's convert_model)",
    "compat/utils/deepspeed.py": "Accelerate's accelerate.utils.deepspeed names (DummyOptim, ...)",
    "compat/utils/modeling.py": "Accelerate's has_transformer_engine_layers",
    "compat/utils/other.py": "Accelerate's get_active_deepspeed_plugin and its state's deepspeed_plugin",
    "compat/state.py": "AcceleratorState's deepspeed_plugins, get_deepspeed_plugin and select_deepspeed_plugin "
    "(Accelerate's names)",
}
PLUGIN_NAMES = (
    "te",
    "ao",
    "msamp",
    "ms-amp",
    "deepspeed",
    "fsdp",
    "fsdp2",
    "ddp",
    "torchao",
    "transformer_engine",
    "transformer-engine",
    "lowbit-te",
    "lowbit-ao",
    "lowbit-msamp",
    "lowbit-deepspeed",
)
WORD = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, PLUGIN_NAMES)) + r")(?![A-Za-z0-9])", re.IGNORECASE)


def plugin_names_in_code(path: Path) -> list[str]:
    """String literals of ``path`` (docstrings aside) that name a plugin, as 'line: text'."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{node.lineno}: {node.value[:80]!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and WORD.search(node.value)
    ]


def core_modules() -> list[Path]:
    return [
        p
        for p in sorted(CORE.rglob("*.py"))
        if "builtin" not in p.relative_to(CORE).parts and p.relative_to(CORE).as_posix() not in PLUGIN_NAMING_MODULES
    ]


def test_no_core_module_names_a_plugin():
    offenders = {p.relative_to(CORE).as_posix(): found for p in core_modules() if (found := plugin_names_in_code(p))}
    assert not offenders, (
        "these core modules name plugins; ask the plugin's description instead "
        f"(or, for Accelerate's own names, map them in accelerate_names.py): {offenders}"
    )


def test_the_check_sees_a_plugin_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""The docstring may say deepspeed."""\nSTRATEGY = {"DEEPSPEED": "deepspeed"}\nNOTE = "non-zero, often"\n'
    )
    assert [line.split(":")[0] for line in plugin_names_in_code(planted)] == ["2", "2"]


def test_the_allowed_modules_exist_and_say_why():
    for module, why in PLUGIN_NAMING_MODULES.items():
        assert (CORE / module).is_file() and why, module


# The layers and the import loops: tests/test_layers.py.


# Private names of other libraries' objects that lowbit has to touch, each for a reason.
FOREIGN_PRIVATE = {
    "_cdata": "a torch storage's identity (meta tensors have no data pointer to compare)",
    "_actions": "argparse: the flags a parser defines (did-you-mean for a misspelt one)",
    "_SubParsersAction": "argparse: the subcommands of a parser",
    "_dynamo": "torch._dynamo.list_backends",
    "_foreach_norm": "torch's fused per-tensor norms with an accumulation dtype (get_total_norm uses it inside; no "
    "public form takes a dtype)",
    "_orig_mod": "torch.compile's wrapper",
    "_modules": "a module's child table: compile_regions gives the twin its own (copy.copy would share it)",
    "_step_count": "torch LR schedulers (OneCycleLR's end)",
    "_wrapped_by_lr_sched": "torch's LRScheduler step marker",
    "_opt_called": "torch's LRScheduler step marker",
    "_option_string_actions": "argparse: a flag already defined",
    "_exit": "os._exit at a failed rank's exit",
    "_shared_state": "PartialState's own class state (Accelerate's name: transformers reads it)",
    "_reset_state": "PartialState's own class method",
    "_run_request": "the Accelerator's own hook, extended by the Accelerator a Trainer gets (its subclass)",
    "_flatten": "torch's DeviceMesh: the only way to name a joint dimension (dp, dp_shard_cp)",
    "_set_params_and_buffers_to_ignore_for_model": "DDP's own way to leave tensors out of its buckets and broadcasts "
    "(FP8 data: gloo has no float8 type)",
    "_get_fsdp_state": "FSDP2's per-parameter records: it has no per-parameter mixed-precision policy, and FP8 data "
    "must be gathered as stored",
}


def test_collaborators_read_no_private_member_of_another_object():
    """``acc._models``, ``acc._call`` and the like: a collaborator gets what it needs instead."""
    found = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith(("__", "_lowbit"))
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and node.attr not in FOREIGN_PRIVATE
            ):
                found.append(f"{path.relative_to(CORE)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
