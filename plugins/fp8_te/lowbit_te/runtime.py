"""What needs Transformer Engine itself: its own hardware checks, the recipe object, autocast."""

from __future__ import annotations

import dataclasses
import inspect
import os
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

from lowbit.kernel.plugin_api import (
    BackendUnavailableError,
    ConfigError,
    PrepareContext,
    UnsupportedCombinationError,
    note,
)

# Options Accelerate passes to DelayedScaling that TE 2.x removed, with the value that means
# "TE 2.x's behaviour" (scaling factors update every step; no per-GEMM override).
REMOVED_IN_TE2 = {"interval": 1, "override_linear_precision": (False, False, False)}
RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "mxfp8": "MXFP8BlockScaling",
    "block": "Float8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
# lowbit's NVFP4 options -> NVFP4BlockScaling's fields, which say the opposite (disable_*), and the
# environment variables whose value TE reads into each field's default when its recipe module is
# imported (common/recipe/__init__.py, 2.9.0 and 2.20.2).
NVFP4_SWITCHES = {
    "nvfp4_random_hadamard": ("disable_rht", "NVTE_NVFP4_DISABLE_RHT"),
    "nvfp4_stochastic_rounding": ("disable_stochastic_rounding", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"),
    "nvfp4_2d_weight_scaling": ("disable_2d_quantization", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION"),
}


def import_te() -> tuple[Any, Any]:
    """``transformer_engine.pytorch`` and its recipe module, or a clear error."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except Exception as exc:  # noqa: BLE001 - TE fails to import in many ways (CUDA libs, ABI)
        raise BackendUnavailableError(f"transformer_engine not importable: {type(exc).__name__}: {exc}") from None
    return te, recipe


def _te_check(te: Any, name: str) -> tuple[bool, str]:
    available, reason = getattr(te, name)(return_reason=True)
    return bool(available), str(reason)


def check_runtime(context: PrepareContext) -> None:
    """TE's own verdict on this GPU, for FP8 and (when asked) MXFP8; and the recipe must build."""
    te, _ = import_te()
    ok, why = _te_check(te, "is_fp8_available")
    if not ok:
        raise BackendUnavailableError(
            f"Transformer Engine reports FP8 unavailable on {context.hardware.describe()}: {why}"
        )
    build_recipe(context)


def build_recipe(context: PrepareContext) -> Any:
    """The TE recipe object for these options; every option reaches TE with its value."""
    te, recipe_module = import_te()
    options = context.backend_options
    if options.te_recipe is not None:
        if not isinstance(options.te_recipe, recipe_module.Recipe):
            raise ConfigError(
                "TERecipeKwargs(te_recipe=...) expects a transformer_engine.common.recipe.Recipe, got "
                f"{type(options.te_recipe).__name__}."
            )
        return options.te_recipe
    _check_te_supports(te, options.recipe, context)
    if options.recipe == "delayed" and context.compiled:
        raise UnsupportedCombinationError(
            "Transformer Engine's DelayedScaling recipe (recipe='delayed', the default) raises under torch.compile. "
            "Use recipe='current' with dynamo_backend, or train without dynamo_backend."
        )
    if options.fp8_format == "E5M2":
        raise ConfigError(
            "fp8_format='E5M2' (pure E5M2 training) is not supported by Transformer Engine; use HYBRID or E4M3."
        )
    cls = getattr(recipe_module, RECIPE_CLASSES[options.recipe], None)
    if cls is None:
        raise BackendUnavailableError(
            f"recipe={options.recipe!r} needs Transformer Engine's {RECIPE_CLASSES[options.recipe]}, which this TE "
            f"({_te_version()}) does not have (NVFP4BlockScaling: TE 2.8+). `pip install -U "
            "transformer-engine[pytorch]`."
        )
    accepted = (
        {f.name for f in dataclasses.fields(cls)}
        if dataclasses.is_dataclass(cls)
        else set(inspect.signature(cls).parameters)
    )
    _refuse_options_the_recipe_ignores(options, cls)
    if options.recipe == "nvfp4":
        if not options.is_default("fp8_format"):
            raise ConfigError(
                f"fp8_format={options.fp8_format!r} cannot reach Transformer Engine with recipe='nvfp4': "
                "NVFP4BlockScaling's block scales are always E4M3. Remove the option."
            )
        return _nvfp4_recipe(cls, options)
    wanted = {}
    # HYBRID is Accelerate's default for delayed scaling; the block recipes default to E4M3 in TE
    # (common/recipe/__init__.py, MXFP8BlockScaling and Float8BlockScaling, 2.20.2): they get
    # HYBRID only when the user asks for it.
    if options.recipe in ("delayed", "current") or not options.is_default("fp8_format"):
        wanted["fp8_format"] = recipe_module.Format[options.fp8_format]
    if options.recipe == "delayed":
        wanted.update(
            margin=options.margin,
            amax_history_len=options.amax_history_len,
            amax_compute_algo=options.amax_compute_algo,
        )
    elif options.recipe == "mxfp8":
        wanted["margin"] = options.margin
    for name, neutral in REMOVED_IN_TE2.items():
        value = getattr(options, name)
        if name in accepted:
            wanted[name] = value
        elif value != neutral:
            raise ConfigError(
                f"{name}={value!r} cannot reach this Transformer Engine: its {cls.__name__} has no {name!r} "
                f"(removed in TE 2.x, which behaves as {name}={neutral!r}). Remove the option."
            )
    if options.recipe == "delayed" and "override_linear_precision" in wanted:
        wanted["override_linear_precision"] = tuple(wanted["override_linear_precision"])
    return cls(**wanted)


# Options of delayed scaling that the other recipes have no field for (common/recipe/__init__.py,
# 2.20.2: Float8CurrentScaling and Float8BlockScaling take neither; MXFP8BlockScaling takes margin).
_DELAYED_ONLY = ("margin", "amax_history_len", "amax_compute_algo")


def _nvfp4_recipe(cls: type, options: Any) -> Any:
    """NVFP4BlockScaling with the switches the user set; the others keep TE's defaults, which TE's
    own NVTE_NVFP4_DISABLE_* variables decide (and which equal lowbit's defaults when they are unset).
    A lowbit option that overrides such a variable says so."""
    te_defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    given = {}
    for option, (field, variable) in NVFP4_SWITCHES.items():
        if options.is_default(option):
            continue
        given[field] = not getattr(options, option)
        if field in te_defaults and given[field] != te_defaults[field]:
            note(
                f"lowbit-te: {option}={getattr(options, option)} overrides {variable}="
                f"{os.environ.get(variable, '(unset)')} (Transformer Engine's own switch for {field})."
            )
    return cls(**given)


def _refuse_options_the_recipe_ignores(options: Any, cls: type) -> None:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    ignored = [name for name in _DELAYED_ONLY if not options.is_default(name) and name not in fields]
    if ignored and options.recipe != "delayed":
        raise ConfigError(
            f"{', '.join(f'{n}={getattr(options, n)!r}' for n in ignored)} cannot reach Transformer Engine with "
            f"recipe={options.recipe!r}: its {cls.__name__} has no such option (they belong to delayed scaling). "
            "Remove them, or use recipe='delayed'."
        )


def _check_te_supports(te: Any, recipe: str, context: PrepareContext) -> None:
    """TE's own verdict on this GPU for recipes beyond plain FP8 (TE checks at the first forward;
    say it at prepare() instead). lowbit has already checked the compute capability it needs."""
    # TE's own verdict for the recipes that need more than FP8 (pytorch/quantization.py, 2.20.2):
    # e.g. MXFP8 is refused on sm_120 though it is Blackwell.
    if recipe == "mxfp8":
        ok, why = _te_check(te, "is_mxfp8_available")
    elif recipe == "nvfp4":
        ok, why = _te_check(te, "is_nvfp4_available")
    elif recipe == "block":
        ok, why = _te_check(te, "is_fp8_block_scaling_available")
    else:
        return
    if not ok:
        raise BackendUnavailableError(
            f"Transformer Engine cannot run recipe={recipe!r} on {context.hardware.describe()}: {why} "
            "Use recipe='delayed' or 'current' (FP8 on sm_89+)."
        )


def _te_version() -> str:
    from lowbit.kernel.plugin_api import installed_version

    return "transformer-engine " + (installed_version("transformer-engine") or "of unknown version")


def fp8_autocast_factory(model: Any, context: PrepareContext) -> Callable[[], ContextManager]:
    """TE's autocast (``te.autocast``, TE >= 2.9) as a factory, its recipe and amax reduction group
    (the data-parallel group) decided once; off in eval unless ``use_autocast_during_eval``."""
    te, _ = import_te()
    recipe, group = run_recipe(context), _data_parallel_group(context)

    def on() -> ContextManager:
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)

    if model is None or context.backend_options.use_autocast_during_eval:
        return on

    def in_training() -> ContextManager:
        return on() if model.training else nullcontext()

    return in_training


@dataclasses.dataclass
class TERunState:
    """lowbit-te's state for one run (``context.plugin_state(TERunState)``)."""

    recipe: Any = None


def run_recipe(context: PrepareContext) -> Any:
    """The one recipe object of this run: built once (autocast is entered every forward), and the
    same object restored FP8 state is bound to, so TE sees no recipe change at the next forward."""
    state = context.plugin_state(TERunState)
    if state.recipe is None:
        state.recipe = build_recipe(context)
    return state.recipe


def _data_parallel_group(context: PrepareContext) -> Any:
    if context.world_size <= 1:
        return None
    import torch.distributed as dist

    # TE reduces its amax over the data-parallel group; lowbit gives TE data parallelism only (FSDP2
    # or DDP over every rank; tensor parallel is not offered with TE), so that group is the world.
    return dist.group.WORLD
