"""lowbit-te: NVIDIA Transformer Engine as a lowbit FP8 backend (priority 200).

This entry module stays import-light: ``transformer_engine`` is imported only once TE has been
chosen and ``prepare`` runs.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util

from lowbit import hookimpl
from lowbit.recipes import recipe_launch_hooks
from lowbit.types import BackendDescription, HardwareInfo, PrepareContext
from lowbit_te.recipe import TERecipeKwargs

NAME = "te"
PRIORITY = 200
# te.autocast, te.is_fp8_available and te.is_mxfp8_available, which this plugin calls, first
# appear in TE 2.9; older releases are refused with the upgrade command.
MIN_TE = (2, 9)
INSTALL = "`pip install lowbit-te[te]` (transformer-engine[pytorch], needs CUDA)"


def unavailable_reason(hardware: HardwareInfo) -> str:
    """Why TE cannot run here, or ''. Checks metadata and hardware; imports nothing."""
    if importlib.util.find_spec("transformer_engine") is None:
        return f"transformer_engine not importable: not installed; {INSTALL}"
    try:
        version = importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    if version and tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < MIN_TE:
        return f"transformer_engine {version} is older than the supported {MIN_TE[0]}.{MIN_TE[1]}: `pip install -U transformer-engine[pytorch]`"
    return hardware.fp8_gemm_problem()


@hookimpl
def describe_backend(hardware: HardwareInfo) -> BackendDescription:
    reason = unavailable_reason(hardware)
    return BackendDescription(
        name=NAME, kind="fp8", priority=PRIORITY, available=not reason, reason=reason,
        options_class=TERecipeKwargs, aliases=("transformer_engine", "transformerengine", "transformersengine"),
    )


@hookimpl
def check_compatibility(context: PrepareContext) -> None:
    from lowbit_te.runtime import check_runtime

    check_runtime(context)


@hookimpl
def convert_model(model, context: PrepareContext):
    from lowbit_te.convert import convert

    return convert(model, context)


@hookimpl
def autocast_context(model, context: PrepareContext):
    from lowbit_te.runtime import fp8_autocast

    return fp8_autocast(model, context)


@hookimpl
def export_state_dict(model, state_dict, context: PrepareContext):
    # te.Linear / te.LayerNorm keep nn.Linear's parameter names; FP8 scaling metadata lives in
    # "_extra_state" entries, which belong in save_state only.
    return {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}


add_launch_arguments, launch_environment = recipe_launch_hooks(TERecipeKwargs, "fp8 backend te (Transformer Engine)")
