"""``lowbit new-backend NAME``: a ready-to-install backend or strategy distribution.

For a low-precision backend (``--kind backend``, the default; ``--precision fp4`` for a precision
of its own) the module it writes holds ``describe_backend`` (filled in), ``convert_model`` (the
one function to fill in) and every other backend hook as an inactive stub carrying the hook's
own documentation from ``lowbit.kernel.hookspecs``: adding ``@hookimpl`` above one turns it on. For a
distributed strategy (``--kind strategy``) it holds a working ``wrap_for_distribution`` (plain
DDP, to change) and the other strategy hooks as stubs. The test it writes runs the conformance
kit through the entry point, as users' runs find the plugin.
"""

from __future__ import annotations

import inspect
import keyword
import re
import string
import textwrap
from pathlib import Path

from lowbit.kernel.errors import ConfigError

# The hooks a low-precision backend may implement, besides describe_backend and convert_model.
OPTIONAL_FP8_HOOKS = (
    "check_compatibility",
    "wrap_optimizer",
    "prepare_model_and_optimizer",
    "autocast_context",
    "after_optimizer_step",
    "clip_grad_norm",
    "strategy_integration",
    "enable_fp8_telemetry",
    "export_state_dict",
)
# The hooks a distributed strategy may implement, besides describe_backend and wrap_for_distribution.
OPTIONAL_STRATEGY_HOOKS = (
    "check_compatibility",
    "backward",
    "clip_grad_norm",
    "full_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "add_launch_arguments",
    "launch_environment",
)
FILL_IN_MARKER = "raise NotImplementedError"
KINDS = ("backend", "strategy")


def check_name(name: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ConfigError(
            f"backend name {name!r} must be lower case letters, digits and _ (starting with a letter), "
            "as users type it in mixed_precision configs: for example 'myfp8'."
        )
    return name


def _stub(hook: str) -> str:
    from lowbit.kernel import hookspecs

    spec = getattr(hookspecs, hook)
    # hookspecs' annotations are strings (postponed evaluation): written unquoted, as in hand-written code
    signature = (
        str(inspect.signature(spec))
        .replace("'", "")
        .replace("torch.nn.Module", "Any")
        .replace("torch.optim.Optimizer", "Any")
    )
    doc = textwrap.indent(inspect.getdoc(spec) or "", "    ")
    return (
        f"# Inactive: put @hookimpl above it to use it.\n"
        f"def {hook}{signature}:\n"
        f'    """{doc.strip()}\n    """\n'
        f"    return None\n"
    )


TEMPLATES = Path(__file__).parent / "templates"


def render(template: str, name: str, precision: str = "fp8", what: str = "") -> str:
    """The text of ``templates/<template>.tmpl`` for plugin ``name`` (``$name``, ``$precision``, ...)."""
    hooks = OPTIONAL_STRATEGY_HOOKS if template.startswith("strategy") else OPTIONAL_FP8_HOOKS
    text = (TEMPLATES / f"{template}.tmpl").read_text(encoding="utf-8")
    return string.Template(text).substitute(
        name=name,
        name_repr=repr(name),
        upper=name.upper(),
        upper_repr=repr(name.upper()),
        precision=precision,
        precision_repr=repr(precision),
        what=what,
        fill_in=FILL_IN_MARKER,
        stubs="\n\n".join(_stub(hook) for hook in hooks) if template.endswith("module.py") else "",
    )


def module_text(name: str, precision: str = "fp8") -> str:
    """The backend module ``lowbit new-backend`` writes (the conformance tests execute it)."""
    return render("backend_module.py", name, precision)


def write_backend(name: str, parent: Path, kind: str = "backend", precision: str = "fp8") -> Path:
    """Write the distribution into ``parent/lowbit-NAME``; refuses to touch an existing directory.
    ``kind``: "backend" (a low-precision backend serving ``precision``) or "strategy"."""
    from lowbit.kernel.types import NATIVE_PRECISIONS

    name = check_name(name)
    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r} is not one of {', '.join(KINDS)}.")
    if precision in NATIVE_PRECISIONS or not re.fullmatch(r"[a-z][a-z0-9_]*", precision):
        raise ConfigError(
            f"--precision {precision!r}: a backend's own precision name, lower case, not one torch's autocast "
            f"serves ({', '.join(sorted(NATIVE_PRECISIONS))}): for example 'fp8' or 'fp4'."
        )
    root = Path(parent) / f"lowbit-{name}"
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or directory (nothing was written).")
    what = "Distributed strategy" if kind == "strategy" else f"{precision.upper()} backend"
    files = {
        root / "pyproject.toml": render("pyproject.toml", name, precision, what),
        root / "README.md": render(f"{kind}_README.md", name, precision),
        root / f"lowbit_{name}" / "__init__.py": render(f"{kind}_module.py", name, precision),
        root / "tests" / "test_conformance.py": render(f"{kind}_test.py", name, precision),
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root
