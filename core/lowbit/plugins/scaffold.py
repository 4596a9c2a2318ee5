"""``lowbit new-backend NAME``: a ready-to-install backend or strategy distribution.

For a low-precision backend (``--kind backend``, the default; ``--precision fp4`` for a precision
of its own) the module it writes holds ``describe_backend`` (filled in), ``convert_model`` (the
one function to fill in) and every other backend hook as an inactive stub carrying the hook's
own documentation from ``lowbit.hookspecs``: adding ``@hookimpl`` above one turns it on. For a
distributed strategy (``--kind strategy``) it holds a working ``wrap_for_distribution`` (plain
DDP, to change) and the other strategy hooks as stubs. The test it writes runs the conformance
kit through the entry point, as users' runs find the plugin.
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
# The hooks a distributed strategy may implement, besides describe_backend and wrap_for_distribution.
OPTIONAL_STRATEGY_HOOKS = ("check_compatibility", "backward", "clip_grad_norm", "full_state_dict", "save_checkpoint",
                           "load_checkpoint", "add_launch_arguments", "launch_environment")
FILL_IN_MARKER = "raise NotImplementedError"
KINDS = ("backend", "strategy")


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


def module_text(name: str, precision: str = "fp8") -> str:
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
# Ranks this backend among the installed ones when the user names none: the first-party backends take 100 to 300 (`lowbit plugins` lists them).
PRIORITY = 50


@hookimpl
def describe_backend(hardware: HardwareInfo) -> BackendDescription:
    """Say whether {name!r} can run here, from package metadata and ``hardware``, without importing anything heavy."""
    has_torch = importlib.util.find_spec("torch") is not None
    return BackendDescription(
        name=NAME, priority=PRIORITY, available=has_torch,
        reason="" if has_torch else "torch not installed: `pip install torch`",
        precisions=({precision!r},),  # Accelerator(mixed_precision={precision!r}) reaches this backend
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


def strategy_module_text(name: str) -> str:
    stubs = "\n\n".join(_stub(hook) for hook in OPTIONAL_STRATEGY_HOOKS)
    return f'''"""lowbit-{name}: a distributed strategy for lowbit.

Discovery imports this module for every lowbit run, on every rank: keep it import-light. Import
torch inside the hooks, which run only once {name!r} is chosen (``distributed_type: {name}``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowbit import hookimpl
from lowbit.types import HardwareInfo, PrepareContext, StrategyDescription

if TYPE_CHECKING:  # annotations only: torch is imported inside the hooks
    import argparse

    import torch

NAME = "{name}"


@hookimpl
def describe_backend(hardware: HardwareInfo) -> StrategyDescription:
    """Say whether {name!r} can run here, without importing anything heavy, and what the strategy is,
    so lowbit never needs its name: the distributed_type values that choose it, the Accelerate type
    it reports as, its config section (its options arrive as context.strategy_options), its
    `lowbit launch --use_{name}` switch."""
    return StrategyDescription(name=NAME, priority=1, available=True, distributed_types=({name.upper()!r},),
                               reports_as="MULTI_GPU", config_section="{name}_config", launch_flag="use_{name}")


@hookimpl
def wrap_for_distribution(model: Any, optimizer: Any, context: PrepareContext) -> Any:
    """Wrap the (already precision-converted) model and optimizer for this process's share of the work.

    As written: DistributedDataParallel, which makes {name!r} train and pass its test right away.
    Change it into your strategy; ``lowbit.testing.run_strategy_conformance`` checks that ranks
    agree, match one process on the same global batch, and resume.
    """
    from torch.nn.parallel import DistributedDataParallel

    if model is not None:
        device_ids = [context.device.index or 0] if context.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    return model, optimizer


{stubs}'''


def strategy_test_text(name: str) -> str:
    return f'''"""The lowbit strategy conformance kit, through the entry point (2 processes under lowbit launch)."""
from lowbit.testing import run_strategy_conformance


def test_{name}_keeps_the_lowbit_contract(tmp_path):
    run_strategy_conformance("{name}", tmp_path)
'''


def pyproject_text(name: str, what: str = "FP8 backend") -> str:
    return f'''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "lowbit-{name}"
version = "0.1.0"
description = "{what} {name!r} for lowbit."
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


def readme_text(name: str, precision: str = "fp8") -> str:
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
   `Accelerator(mixed_precision="{precision}", kwargs_handlers=[FP8RecipeKwargs(backend="{name}")])`.

The contract, with what the kit checks: lowbit's docs/writing-a-backend.md.
'''


def strategy_readme_text(name: str) -> str:
    return f'''# lowbit-{name}

A distributed strategy for [lowbit](https://github.com/lowbit/lowbit), made by `lowbit new-backend {name} --kind strategy`.

```bash
pip install -e ".[test]"        # registers the entry point: `lowbit plugins` lists {name!r}
pytest                          # the strategy conformance kit: 2 processes under lowbit launch, against one
lowbit launch --cpu --num_processes 2 --distributed_type {name} train.py   # or --use_{name}, or distributed_type: {name.upper()}
```

1. Change `wrap_for_distribution` in `lowbit_{name}/__init__.py` (as written: torch's DistributedDataParallel, which passes).
2. Adjust `TRAITS`: the `distributed_type` values that choose it, the Accelerate type it reports
   as, its config section `{name}_config` (its keys arrive as `context.strategy_options`), whether
   it applies fp16/bf16 itself (`owns_precision`), how its state is saved (`checkpoint`).
3. Turn on the optional hooks you need (put `@hookimpl` above a stub); each stub carries its docs.

The contract: lowbit's docs/writing-a-backend.md, "Distributed strategies".
'''


def write_backend(name: str, parent: Path, kind: str = "backend", precision: str = "fp8") -> Path:
    """Write the distribution into ``parent/lowbit-NAME``; refuses to touch an existing directory.
    ``kind``: "backend" (a low-precision backend serving ``precision``) or "strategy"."""
    from lowbit.types import NATIVE_PRECISIONS

    name = check_name(name)
    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r} is not one of {', '.join(KINDS)}.")
    if precision in NATIVE_PRECISIONS or not re.fullmatch(r"[a-z][a-z0-9_]*", precision):
        raise ConfigError(f"--precision {precision!r}: a backend's own precision name, lower case, not one torch's autocast "
                          f"serves ({', '.join(sorted(NATIVE_PRECISIONS))}): for example 'fp8' or 'fp4'.")
    root = Path(parent) / f"lowbit-{name}"
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or directory (nothing was written).")
    if kind == "strategy":
        files = {
            root / "pyproject.toml": pyproject_text(name, "Distributed strategy"),
            root / "README.md": strategy_readme_text(name),
            root / f"lowbit_{name}" / "__init__.py": strategy_module_text(name),
            root / "tests" / "test_conformance.py": strategy_test_text(name),
        }
    else:
        files = {
            root / "pyproject.toml": pyproject_text(name, f"{precision.upper()} backend"),
            root / "README.md": readme_text(name, precision),
            root / f"lowbit_{name}" / "__init__.py": module_text(name, precision),
            root / "tests" / "test_conformance.py": test_text(name),
        }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root
