"""lowbit-te: NVIDIA Transformer Engine as a lowbit FP8 backend (priority 200).

This entry module stays import-light: ``transformer_engine`` is imported only once TE has been
chosen and ``prepare`` runs.
"""

from __future__ import annotations

import importlib.util

from lowbit import hookimpl

from lowbit.kernel.plugin_api import (
    BackendDescription,
    HardwareInfo,
    PrepareContext,
    StrategyIntegration,
    UnsupportedCombinationError,
    installed_version,
    older_than,
    recipe_launch_hooks,
)

from lowbit_te.costs import RECIPE_COSTS
from lowbit_te.recipe import RECIPE_NAMES, TERecipeKwargs

NAME = "te"
PRIORITY = 200
# te.autocast, te.is_fp8_available and te.is_mxfp8_available, which this plugin calls, first
# appear in TE 2.9; older releases are refused with the upgrade command.
MIN_TE = "2.9"
INSTALL = "`pip install lowbit-te[te]` (transformer-engine[pytorch], needs CUDA)"


def _incomplete_install(version: str) -> str:
    """What keeps ``import transformer_engine.pytorch`` from working, read from metadata alone.

    PyPI's ``transformer-engine`` is a small pure-Python wheel; the PyTorch extension
    (``transformer_engine_torch``) and the CUDA core (``transformer_engine_cu12``/``_cu13``) are
    separate distributions pinned to the same version (its Requires-Dist, 2.9.0 and 2.20.2), and
    ``transformer_engine.pytorch`` imports the extension at import time. A source build ships all
    three in one distribution; then only the extension module is looked for."""
    fix = f"`pip install \"transformer-engine[pytorch]=={version}\"`" if version else INSTALL
    if importlib.util.find_spec("transformer_engine_torch") is None:
        return (
            f"transformer_engine {version} is installed without its PyTorch extension (transformer_engine_torch), "
            f"so it cannot be imported: {fix}"
        )
    for extension in ("transformer_engine_torch", "transformer_engine_cu12", "transformer_engine_cu13"):
        other = installed_version(extension)
        if version and other and other != version:
            return f"transformer_engine {version} and {extension} {other} differ (they load only as one version): {fix}"
    return ""


def unavailable_reason(hardware: HardwareInfo) -> str:
    """Why TE cannot run here, or ''. Checks hardware (first: installing TE would not help on a CPU)
    and metadata; imports nothing."""
    problem = hardware.fp8_gemm_problem()
    if problem:
        installed = importlib.util.find_spec("transformer_engine") is not None
        return f"Transformer Engine {problem}" + ("" if installed else f" (and it is not installed: {INSTALL})")
    if importlib.util.find_spec("transformer_engine") is None:
        return f"transformer_engine not importable: not installed; {INSTALL}"
    version = installed_version("transformer_engine") or ""
    if version and older_than(version, MIN_TE):
        return (
            f"transformer_engine {version} is older than the supported {MIN_TE}: "
            "`pip install -U transformer-engine[pytorch]`"
        )
    return _incomplete_install(version)


@hookimpl
def describe_backend(hardware: HardwareInfo) -> BackendDescription:
    reason = unavailable_reason(hardware)
    return BackendDescription(
        name=NAME,
        priority=PRIORITY,
        available=not reason,
        reason=reason,
        options_class=TERecipeKwargs,
        aliases=("transformer_engine", "transformerengine", "transformersengine"),
        libraries=("transformer-engine",),
        precisions=("fp8", "fp4"),
        recipes=RECIPE_NAMES,
        recipe_costs=RECIPE_COSTS,
    )


@hookimpl
def check_compatibility(context: PrepareContext) -> None:
    if context.parallelism is not None and context.parallelism.tp_enabled:
        # TE splits its modules over ranks itself (te.Linear(parallel_mode=..., tp_group=...)), at
        # construction; lowbit converts a built model and does not wire those arguments.
        raise UnsupportedCombinationError(
            f"tp_size={context.parallelism.tp_size}: lowbit-te does not lay Transformer Engine's modules out over "
            "tensor-parallel ranks. Use the ao backend (fp8_config backend: ao), whose float8 layers take torchao's "
            "tensor-parallel styles, or shard with FSDP2 alone (dp_shard_size) under te."
        )
    from lowbit_te.runtime import check_runtime

    check_runtime(context)


@hookimpl
def strategy_integration(strategy: str, context: PrepareContext):
    # TE's own recompute (te.distributed.checkpoint) runs a checkpointed block again under the
    # forward's FP8 settings and scales; torch's would recompute it outside te.autocast, in high precision.
    import transformer_engine.pytorch as te

    return StrategyIntegration(activation_checkpoint=te.distributed.checkpoint)


@hookimpl
def convert_model(model, context: PrepareContext, layer_roles):
    from lowbit_te.convert import convert

    return convert(model, context, layer_roles)


@hookimpl
def autocast_context(model, context: PrepareContext):
    from lowbit_te.runtime import fp8_autocast_factory

    return fp8_autocast_factory(model, context)


@hookimpl
def backend_checkpoint_state(model, context: PrepareContext):
    from lowbit_te.fp8_state import scaling_state

    return scaling_state(model) or None


@hookimpl
def load_backend_checkpoint_state(model, state, context: PrepareContext):
    from lowbit_te.fp8_state import load_scaling_state
    from lowbit_te.runtime import run_recipe

    load_scaling_state(model, state, run_recipe(context))
    return True


@hookimpl
def decode_checkpoint_state(kind, owner, state, context: PrepareContext):
    from lowbit_te.fp8_state import without_pickled_extra_state

    return without_pickled_extra_state(state) if kind == "model" else None


@hookimpl
def export_state_dict(model, state_dict, context: PrepareContext):
    # te.Linear / te.LayerNorm keep nn.Linear's parameter names; FP8 scaling metadata lives in
    # "_extra_state" entries, which belong in save_state only.
    return {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}


add_launch_arguments, launch_environment = recipe_launch_hooks(TERecipeKwargs, "fp8 backend te (Transformer Engine)")
