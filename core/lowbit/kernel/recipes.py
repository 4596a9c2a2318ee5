"""Recipe-kwargs base classes: how a backend's options are declared, filled and validated.

A backend plugin declares its options as a dataclass deriving from :class:`RecipeKwargs`, with
every field made by :func:`recipe_option`. Fields left as None are filled, in order, from the
``LOWBIT_FP8_*`` environment variables (on construction), then from the config file's
``fp8_config`` section, then from the option's default. So an explicit argument always wins.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, ClassVar, Mapping

from lowbit.kernel.errors import ConfigError, did_you_mean
from lowbit.kernel.options import OptionSpec, at_least, to_text

FP8_ENV_PREFIX = "LOWBIT_FP8_"
# Accelerate's docs spell opt_level two ways; lowbit-te called its recipe "scaling" before the
# recipe vocabulary (lowbit.kernel.recipe_names) gave every backend the one name "recipe".
OPTION_SYNONYMS = {"optimization_level": "opt_level", "scaling": "recipe"}


def fp8_env_var(key: str) -> str:
    """``fp8_format`` -> ``LOWBIT_FP8_FORMAT``, ``margin`` -> ``LOWBIT_FP8_MARGIN``."""
    return FP8_ENV_PREFIX + (key[4:] if key.startswith("fp8_") else key).upper()


def recipe_option(
    default: Any = None,
    *,
    type: Any = str,
    choices: tuple[str, ...] | None = None,
    help: str = "",
    code_only: bool = False,
    normalize: Any = None,
) -> Any:
    """A recipe field: None until filled, with its real default and type kept in metadata.

    ``normalize`` runs on every value (argument, env var, YAML) before the choices are checked;
    it may raise ConfigError with a more helpful message than "unknown value"."""
    return dataclasses.field(
        default=None,
        metadata={
            "lowbit": dict(
                type=type, default=default, choices=choices, help=help, code_only=code_only, normalize=normalize
            )
        },
    )


def recipe_name_option(default: str | None, help: str = "", own: tuple[Any, ...] = ()) -> Any:
    """The ``recipe`` field every backend's kwargs class declares: a name of the recipe
    vocabulary (``lowbit.kernel.recipe_names``) or one of the backend's ``own`` recipes (the
    ``RecipeInfo`` objects its description declares), checked wherever it is given. Whether
    *this* backend offers it is checked when the backend is chosen, so the error can name the
    backends that do. ``default`` is the backend's fp8 default; fp4 takes its first fp4 recipe."""
    from lowbit.kernel.recipe_names import canonical_recipe

    return recipe_option(
        default,
        help=help or "recipe: format and scaling (`lowbit plugins` lists each backend's)",
        normalize=lambda value: canonical_recipe(value, declared=own),
    )


@dataclasses.dataclass
class RecipeKwargs:
    """Base of every backend's recipe-kwargs class (``AORecipeKwargs``, ``TERecipeKwargs``, ...)."""

    backend_name: ClassVar[str] = ""

    @classmethod
    def option_specs(cls) -> dict[str, OptionSpec]:
        specs = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata.get("lowbit")
            if meta is not None:
                specs[f.name] = OptionSpec(name=f.name, env=fp8_env_var(f.name), **meta)
        return specs

    def __post_init__(self) -> None:
        for name, spec in self.option_specs().items():
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, spec.parse(value, where=type(self).__name__))
            elif not spec.code_only and os.environ.get(spec.env, "") != "":
                setattr(self, name, spec.parse(os.environ[spec.env], where=f"env {spec.env}"))

    def fill_missing(self, values: Mapping[str, Any], where: str) -> None:
        """Fill fields that are still None from ``values`` (e.g. the config file's fp8_config)."""
        specs = self.option_specs()
        for key, value in values.items():
            key = OPTION_SYNONYMS.get(key, key)
            if key in specs and getattr(self, key) is None:
                setattr(self, key, specs[key].parse(value, where=where))

    def fill_defaults(self) -> None:
        defaulted = set()
        for name, spec in self.option_specs().items():
            if getattr(self, name) is None:
                setattr(self, name, spec.default)
                defaulted.add(name)
        # Which options took their default: a backend may treat a default differently from the
        # same value given by the user (e.g. not override a library object the user built).
        object.__setattr__(self, "_lowbit_defaulted", frozenset(defaulted))

    def is_default(self, name: str) -> bool:
        """True when ``name`` was not given (argument, env, config file) and took its default.
        Before :meth:`fill_defaults` has run: whether it holds its default value."""
        defaulted = getattr(self, "_lowbit_defaulted", None)
        if defaulted is None:
            value = getattr(self, name)
            return value is None or value == self.option_specs()[name].default
        return name in defaulted


class FP8RecipeKwargs:
    """Accelerate's catch-all handler: ``FP8RecipeKwargs(backend="te", fp8_format="E4M3", ...)``.

    ``backend`` picks the backend (any spelling: "te", "TE", "msamp", "MSAMP", "ao"); the other
    keywords are that backend's recipe options, checked against its recipe class once it is
    chosen. ``optimization_level`` is accepted as a synonym of ``opt_level``.
    """

    def __init__(self, backend: str | None = None, **options: Any) -> None:
        for alias, real in OPTION_SYNONYMS.items():
            if alias in options:
                if real in options:
                    raise ConfigError(
                        f"FP8RecipeKwargs got both {alias!r} and {real!r}; they are the same option, give one."
                    )
                options[real] = options.pop(alias)
        self.backend = backend if backend is not None else (os.environ.get(fp8_env_var("backend")) or None)
        self.options = options

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {"backend": self.backend, **self.options}.items())
        return f"FP8RecipeKwargs({args})"

    def to_recipe(self, recipe_class: type[RecipeKwargs]) -> RecipeKwargs:
        """Build the chosen backend's recipe object from these options."""
        specs = recipe_class.option_specs()
        unknown = [k for k in self.options if k not in specs]
        if unknown:
            key = unknown[0]
            raise ConfigError(
                f"FP8RecipeKwargs option {key!r} is not an option of the {recipe_class.backend_name!r} backend."
                f"{did_you_mean(key, specs)} Its options: {', '.join(sorted(specs))}."
            )
        return recipe_class(**self.options)


# The fp8_config keys Accelerate documents, so that a config file written for any backend is
# checked even when that backend's plugin is not installed here. Plugins add their own keys.
DOCUMENTED_FP8_KEYS: dict[str, OptionSpec] = {
    spec.name: spec
    for spec in (
        OptionSpec("backend", str, help="the low-precision backend (`lowbit plugins` lists them)"),
        OptionSpec("opt_level", str, help="optimization level, O1 or O2 (letter O)"),
        OptionSpec("amax_history_len", int, help="length of the amax history window", normalize=at_least(1)),
        OptionSpec("amax_compute_algo", str, help="max or most_recent"),
        OptionSpec("fp8_format", str, help="HYBRID, E4M3 or E5M2"),
        OptionSpec("interval", int, help="steps between scaling-factor updates", normalize=at_least(1)),
        OptionSpec("margin", int, help="margin for the scaling factor", normalize=at_least(0)),
        OptionSpec("override_linear_precision", "bools3", help="keep (fprop, dgrad, wgrad) in high precision"),
        OptionSpec("use_autocast_during_eval", bool, help="keep FP8 autocast on in eval mode"),
    )
}


# Options whose launch flag is a switch, as in accelerate launch: a value after it would be the script.
SWITCH_OPTIONS = frozenset({"use_autocast_during_eval"})


def recipe_flag(name: str) -> str:
    """``fp8_format`` -> ``--fp8_format``, ``recipe`` -> ``--fp8_recipe``."""
    return "--" + (name if name.startswith("fp8_") else f"fp8_{name}")


def add_recipe_flags(parser: Any, recipe_class: type[RecipeKwargs], title: str) -> None:
    """Add a ``lowbit launch`` flag for each text-settable option of ``recipe_class``.

    Flags another plugin (or the core) already added are left alone, so two backends may share
    an option name such as ``--fp8_format``.
    """
    group = parser.add_argument_group(title)
    for name, spec in recipe_class.option_specs().items():
        flag = recipe_flag(name)
        if spec.code_only or flag in parser._option_string_actions:
            continue
        metavar = (
            "{" + ",".join(spec.choices) + "}" if spec.choices else getattr(spec.type, "__name__", "VALUE").upper()
        )
        extra = {}
        if spec.type is bool:  # --flag alone is true; --flag false (Accelerate's switches take no value)
            extra = (
                {"action": "store_const", "const": "true"}
                if name in SWITCH_OPTIONS
                else {"nargs": "?", "const": "true"}
            )
        group.add_argument(flag, dest=flag[2:], default=None, metavar=metavar, help=spec.help, **extra)


def recipe_env_from_args(args: Any, recipe_class: type[RecipeKwargs]) -> dict[str, str]:
    """The ``LOWBIT_FP8_*`` env vars for the recipe flags that were given (values checked here)."""
    env = {}
    for name, spec in recipe_class.option_specs().items():
        value = getattr(args, recipe_flag(name)[2:], None)
        if value is not None and not spec.code_only:
            env[spec.env] = to_text(spec.parse(value, where=f"lowbit launch {recipe_flag(name)}"))
    return env


def recipe_launch_hooks(recipe_class: type[RecipeKwargs], title: str) -> tuple[Any, Any]:
    """A backend's two launcher hookimpls when its flags are exactly its recipe options:

    add_launch_arguments, launch_environment = recipe_launch_hooks(AORecipeKwargs, "fp8 backend ao")
    """
    from lowbit.kernel.hookspecs import hookimpl

    @hookimpl
    def add_launch_arguments(parser: Any) -> None:
        add_recipe_flags(parser, recipe_class, title)

    @hookimpl
    def launch_environment(args: Any) -> dict[str, str]:
        return recipe_env_from_args(args, recipe_class)

    return add_launch_arguments, launch_environment


def _fraction(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be a fraction between 0 and 1, got {value}.")
    return value


@dataclasses.dataclass
class FP4RecipeOptions:
    """The options of 4-bit (NVFP4) training, with the same names and defaults on every backend
    that offers it. The defaults are NVIDIA's NVFP4 pretraining recipe (TE 2.20.2
    ``common/recipe/__init__.py``, ``NVFP4BlockScaling``; arXiv 2509.25149): 16x16 blocks for
    weights, stochastic rounding of gradients, random Hadamard transforms before the
    weight-gradient GEMM, and the last layers of the network kept in bf16."""

    fp4_last_layers_bf16: float | None = recipe_option(
        0.15,
        type=float,
        normalize=_fraction,
        help="fraction of the Linear layers, counted from the model's end, kept in bf16 under fp4",
    )
    nvfp4_random_hadamard: bool | None = recipe_option(
        True, type=bool, help="random Hadamard transform (16x16) of the weight-gradient GEMM's operands"
    )
    nvfp4_stochastic_rounding: bool | None = recipe_option(
        True, type=bool, help="round gradients stochastically to FP4"
    )
    nvfp4_2d_weight_scaling: bool | None = recipe_option(
        True, type=bool, help="one scale per 16x16 weight block (else 1x16)"
    )


def fp4_layers_kept_bf16(names: list[str], fraction: float) -> dict[str, str]:
    """The last ``fraction`` of ``names`` (module order), rounded up, with the reason they stay in
    bf16 under fp4. ``fraction`` is checked (0 to 1) where the option is parsed."""
    count = math.ceil(round(len(names) * fraction, 6))  # round: 20 * 0.15 is 3.0000000000000004
    reason = f"in the last {fraction:.0%} of Linears, kept in bf16 (fp4_last_layers_bf16)"
    return dict.fromkeys(names[len(names) - count :] if count else [], reason)
