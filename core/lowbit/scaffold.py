"""``lowbit new-backend NAME``: a ready-to-install FP8 backend distribution.

The module it writes holds ``describe_backend`` (filled in), ``convert_model`` (the one function to
fill in) and every other FP8 hook as an inactive stub carrying the hook's own documentation from
``lowbit.hookspecs``: adding ``@hookimpl`` above one turns it on. The test it writes runs
``lowbit.testing.run_conformance`` through the entry point, as users' runs find the backend.
"""
from __future__ import annotations

import inspect
import keyword
import re
import textwrap
from pathlib import Path

from lowbit.errors import ConfigError

# The hooks an FP8 backend may implement, besides describe_backend and convert_model.
OPTIONAL_FP8_HOOKS = (
    "check_compatibility", "wrap_optimizer", "prepare_model_and_optimizer", "autocast_context", "after_optimizer_step",
    "clip_grad_norm", "strategy_integration", "enable_fp8_telemetry", "export_state_dict",
)
FILL_IN_MARKER = "raise NotImplementedError"


def check_name(name: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ConfigError(f"backend name {name!r} must be lower case letters, digits and _ (starting with a letter), "
                          "as users type it in mixed_precision configs: for example 'myfp8'.")
    return name


def _stub(hook: str) -> str:
    from lowbit import hookspecs

    spec = getattr(hookspecs, hook)
    # hookspecs' annotations are strings (postponed evaluation): written unquoted, as in hand-written code
    signature = str(inspect.signature(spec)).replace("'", "").replace("torch.nn.Module", "Any").replace("torch.optim.Optimizer", "Any")
    doc = textwrap.indent(inspect.getdoc(spec) or "", "    ")
    return (f"# Inactive: put @hookimpl above it to use it.\n"
            f"def {hook}{signature}:\n"
            f'    """{doc.strip()}\n    """\n'
            f"    return None\n")


def module_text(name: str) -> str:
    stubs = "\n\n".join(_stub(hook) for hook in OPTIONAL_FP8_HOOKS)
    return f'''"""lowbit-{name}: an FP8 backend for lowbit.

Discovery imports this module for every lowbit run, on every rank: keep it import-light. Import
torch and your FP8 library inside the hooks, which run only once {name!r} is chosen.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, ContextManager

from lowbit import hookimpl
from lowbit.types import BackendDescription, HardwareInfo, PrepareContext

if TYPE_CHECKING:  # annotations only: torch is imported inside the hooks
    import torch

NAME = "{name}"
# Ranks this backend among the installed ones when the user names none: msamp 300, te 200, ao 100.
PRIORITY = 50


@hookimpl
def describe_backend(hardware: HardwareInfo) -> BackendDescription:
    """Say whether {name!r} can run here, from package metadata and ``hardware``, without importing anything heavy."""
    has_torch = importlib.util.find_spec("torch") is not None
    return BackendDescription(
        name=NAME, kind="fp8", priority=PRIORITY, available=has_torch,
        reason="" if has_torch else "torch not installed: `pip install torch`",
    )


@hookimpl
def convert_model(model: Any, context: PrepareContext) -> Any:
    """Swap the model's eligible layers for FP8 ones, in place, and return the model.

    Keep each layer's parameters (the same ``weight`` and ``bias`` objects, or lowbit remaps the
    optimizer by name), leave their values bit for bit as they were, accept any number of tokens,
    and let gradients reach every parameter. ``context`` says where the run is (hardware, device,
    strategy, rank). ``lowbit.testing.run_conformance`` checks all of it.
    """
    {FILL_IN_MARKER}("lowbit-{name}: fill in convert_model (see the README)")


{stubs}'''


def pyproject_text(name: str) -> str:
    return f'''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "lowbit-{name}"
version = "0.1.0"
description = "FP8 backend {name!r} for lowbit."
requires-python = ">=3.10"
dependencies = ["lowbit>=0.1"]

[project.optional-dependencies]
test = ["pytest>=8"]

# How lowbit finds the backend: the entry point group is "lowbit".
[project.entry-points.lowbit]
{name} = "lowbit_{name}"

[tool.setuptools]
packages = ["lowbit_{name}"]
'''


def test_text(name: str) -> str:
    return f'''"""The lowbit conformance kit, through the entry point (as users' runs find the backend)."""
from lowbit.testing import run_conformance


def test_{name}_keeps_the_lowbit_contract(tmp_path):
    # heavy_modules: your FP8 library, which discovery must not import (torch is always checked).
    run_conformance("{name}", heavy_modules=(), tmp_path=tmp_path, verbose=True)
'''


def readme_text(name: str) -> str:
    return f'''# lowbit-{name}

An FP8 backend for [lowbit](https://github.com/lowbit/lowbit), made by `lowbit new-backend {name}`.

```bash
pip install -e ".[test]"        # registers the entry point: `lowbit plugins` lists {name!r}
pytest                          # the conformance kit: fails until convert_model is filled in
```

1. Fill in `convert_model` in `lowbit_{name}/__init__.py`: swap eligible `nn.Linear` layers for
   your FP8 layers, keeping their `weight`/`bias` Parameters and values.
2. Make `describe_backend` honest: available only where your library and hardware can run,
   with a reason that says what to install or change.
3. Turn on the optional hooks you need (put `@hookimpl` above a stub); each stub carries its docs.
4. `pytest` runs `lowbit.testing.run_conformance`: it trains a small model with your backend and
   says which hook broke what. Users select you with
   `Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="{name}")])`.

The contract, with what the kit checks: lowbit's docs/writing-a-backend.md.
'''


def write_backend(name: str, parent: Path) -> Path:
    """Write the distribution into ``parent/lowbit-NAME``; refuses to touch an existing directory."""
    name = check_name(name)
    root = Path(parent) / f"lowbit-{name}"
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or directory (nothing was written).")
    files = {
        root / "pyproject.toml": pyproject_text(name),
        root / "README.md": readme_text(name),
        root / f"lowbit_{name}" / "__init__.py": module_text(name),
        root / "tests" / "test_conformance.py": test_text(name),
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root
