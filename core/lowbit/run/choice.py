"""Choosing one run's plugins from its settings.

The low-precision backend when ``mixed_precision`` names a precision a backend serves (the one
asked for, else the best ranked), with its recipe options resolved (handler argument > env >
config file > default), or the fallback the user allowed; and the distributed strategy that
``distributed_type`` names, by the strategies' own descriptions. (fp32, fp16 and bf16 need no
plugin: :class:`lowbit.runtime.precision.Precision` serves them.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from lowbit.kernel import notices
from lowbit.kernel.errors import BackendUnavailableError, ConfigError
from lowbit.kernel.recipes import FP8RecipeKwargs, RecipeKwargs, fp8_env_var
from lowbit.kernel.registry import Candidate, PluginRegistry, Selection, choose_plugin
from lowbit.kernel.types import NATIVE_PRECISIONS

from lowbit.run.recipe_choice import RecipeChoice, choose_with_recipe
from lowbit.run.settings import SINGLE_PROCESS_TYPES, env_source


@dataclass
class PluginChoice:
    """What was chosen, and the settings that follow from it."""

    mixed_precision: str  # as asked, or the fp8_fallback taken
    backend: Selection | None = None
    backend_options: RecipeKwargs | None = None
    recipe: RecipeChoice | None = None  # the recipe the backend trains with, and how it runs here
    strategy: Selection | None = None
    handlers: dict[type, Any] = field(default_factory=dict)  # Accelerate's kwargs handlers, by class

    def strategy_options(self, config: Any) -> dict[str, Any]:
        """The chosen strategy's config section, plus the options of the kwargs handler it takes."""
        if self.strategy is None:
            return {}
        strategy = self.strategy.chosen.description
        options = dict(config.section(strategy.config_section))
        handler = next((h for h in self.handlers.values() if type(h).__name__ == strategy.kwargs_handler), None)
        if strategy.kwargs_handler and handler is not None:
            options.update(handler.to_strategy_options())
        return options


def choose_plugins(
    registry: PluginRegistry, config: Any, recipe_handler: Any, handlers: dict[type, Any], num_processes: int
) -> PluginChoice:
    """``recipe_handler``: the one FP8 recipe object given (or None); ``handlers``: the other
    handler objects by class (a strategy takes options from the one it names)."""
    choice = PluginChoice(mixed_precision=config.mixed_precision, handlers=handlers)
    choice.strategy = _choose_strategy(registry, config.distributed_type, num_processes)
    if choice.strategy is not None:
        registry.rule_out_under(choice.strategy.name)
    _choose_backend(choice, registry, config, recipe_handler)
    return choice


def _choose_backend(choice: PluginChoice, registry: PluginRegistry, config: Any, handler: Any) -> None:
    if choice.mixed_precision in NATIVE_PRECISIONS:
        given = ([type(handler).__name__] if handler is not None else []) + _fp8_config_sources(config)
        if given:  # the same error as `lowbit launch` gives, whichever way the options arrived
            raise ConfigError(
                f"FP8 options were given ({'; '.join(given)}) but mixed_precision is "
                f"{choice.mixed_precision!r}, so they "
                "would do nothing. Set mixed_precision='fp8' (or 'fp4'), or drop the FP8 options."
            )
        return
    requested, source = _requested_backend(handler, config)
    recipe, recipe_source = _requested_recipe(registry, handler, config)
    try:
        choice.backend, choice.recipe = choose_with_recipe(
            registry, choice.mixed_precision, requested, source, recipe, recipe_source
        )
    except BackendUnavailableError as exc:
        fallback = config.fp8_fallback
        if not fallback:
            raise BackendUnavailableError(f"{exc} Or set fp8_fallback='bf16' to train in bf16 instead.") from None
        notices.warn(f"FP8 cannot run here, so training falls back to {fallback} (fp8_fallback): {exc}")
        choice.mixed_precision = fallback
        return
    choice.backend_options = _resolve_options(choice.backend.chosen, handler, config)
    if (
        choice.recipe.name is not None
        and getattr(choice.backend_options, "recipe", choice.recipe.name) != choice.recipe.name
    ):
        # The option took the backend's fp8 default; this precision's default recipe is another.
        choice.backend_options.recipe = choice.recipe.name


def _fp8_config_sources(config: Any) -> list[str]:
    """Each fp8_config setting, with where it came from (an env var, as lowbit launch passed it, or the file)."""
    out = []
    for key in config.fp8_config:
        env = fp8_env_var(key)
        out.append(env_source(env, f"env {env}") if os.environ.get(env) else f"config file fp8_config.{key}")
    return out


def _requested_recipe(registry: PluginRegistry, handler: Any, config: Any) -> tuple[str | None, str]:
    """The recipe the user named (vocabulary name, or one an installed backend declares), and
    where: the handler (which has read its env var), ``LOWBIT_FP8_RECIPE`` (``lowbit launch
    --fp8_recipe``), or the config file."""
    from lowbit.kernel.recipe_names import canonical_recipe, known_recipes

    declared = known_recipes(c.description for c in registry.ranked("backend")).values()
    if isinstance(handler, RecipeKwargs) and getattr(handler, "recipe", None) is not None:
        return handler.recipe, type(handler).__name__
    if isinstance(handler, FP8RecipeKwargs) and handler.options.get("recipe") is not None:
        where = "FP8RecipeKwargs(recipe=...)"
        return canonical_recipe(handler.options["recipe"], where, declared), where
    env = fp8_env_var("recipe")
    if os.environ.get(env):
        where = env_source(env, f"env {env} / lowbit launch --fp8_recipe")
        return canonical_recipe(os.environ[env], where, declared), where
    if config.fp8_config.get("recipe") is not None:
        return canonical_recipe(
            config.fp8_config["recipe"], "fp8_config.recipe", declared
        ), "config file fp8_config.recipe"
    return None, "default"


def _requested_backend(handler: Any, config: Any) -> tuple[str | None, str]:
    """The backend the user named, and where (for errors and ``explain_backend_choice``)."""
    if isinstance(handler, RecipeKwargs) and handler.backend_name:
        return handler.backend_name, type(handler).__name__
    if isinstance(handler, FP8RecipeKwargs) and handler.backend:
        return handler.backend, "FP8RecipeKwargs(backend=...)"
    from_config = config.fp8_config.get("backend")
    if from_config:
        env = fp8_env_var("backend")
        if os.environ.get(env):
            return from_config, env_source(env, f"env {env} / lowbit launch --fp8_backend")
        if os.environ.get("ACCELERATE_FP8_BACKEND"):
            return from_config, "env ACCELERATE_FP8_BACKEND / accelerate launch --fp8_backend"
        return from_config, "config file fp8_config.backend"
    return None, "ranking"


def _resolve_options(chosen: Candidate, handler: Any, config: Any) -> RecipeKwargs | None:
    options_class = chosen.description.options_class
    if options_class is None:
        return None
    if isinstance(handler, FP8RecipeKwargs):
        options = handler.to_recipe(options_class)
    elif isinstance(handler, options_class):
        options = handler
    else:
        options = options_class()
    file_values = {k: v for k, v in config.fp8_config.items() if k != "backend"}
    ignored = sorted(set(file_values) - set(options_class.option_specs()))
    if ignored:
        notices.note(
            f"fp8_config keys {', '.join(ignored)} do not apply to the {chosen.name!r} backend and are ignored."
        )
    options.fill_missing(file_values, where="fp8_config")
    options.fill_defaults()
    return options


def _choose_strategy(registry: PluginRegistry, distributed_type: str, num_processes: int) -> Selection | None:
    # One process needs no strategy, unless it asked for MULTI_GPU and joined a process group
    # (lowbit launch --multi_gpu --num_processes 1: DDP on one GPU, as in Accelerate).
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    if (
        num_processes == 1
        and distributed_type.upper() in SINGLE_PROCESS_TYPES
        and not (distributed_type.upper() == "MULTI_GPU" and grouped)
    ):
        return None
    found = registry.strategy_for(distributed_type)
    return choose_plugin(
        registry, "strategy", found.name if found else distributed_type, f"distributed_type={distributed_type}"
    )
