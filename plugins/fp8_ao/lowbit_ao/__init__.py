"""lowbit-ao: torchao float8 training as a lowbit FP8 backend (priority 100).

This entry module stays import-light: torchao is imported only in the hooks that run once the
ao backend has been chosen (``convert``, ``optim``).
"""

from __future__ import annotations

import importlib.util

from lowbit import hookimpl

from lowbit.kernel.plugin_api import (
    BackendDescription,
    HardwareInfo,
    PrepareContext,
    StrategyIntegration,
    installed_version,
    older_than,
    recipe_launch_hooks,
)

from lowbit_ao.costs import RECIPE_COSTS
from lowbit_ao.native_kernels import mxfp8_kernels_problem
from lowbit_ao.recipe import RECIPE_NAMES, AORecipeKwargs

NAME = "ao"
PRIORITY = 100
MIN_TORCHAO = "0.12"
# The oldest torch each torchao release loads its kernels with, as that release's own
# torchao/__init__.py checks it (0.18.0: "2.11.0"; 0.15.0: "2.9.1", pytorch/ao#3455). Releases
# not listed are not checked.
TORCH_FOR_TORCHAO = {"0.18": "2.11", "0.15": "2.9.1"}


def unavailable_reason() -> str:
    """Why torchao cannot be used, or '' when it can. Reads metadata only; imports nothing."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao not installed: `pip install torchao`"
    version = installed_version("torchao")  # None: importable from a source tree, trusted
    if version and older_than(version, MIN_TORCHAO):
        return f"torchao {version} is too old; lowbit-ao needs torchao >= {MIN_TORCHAO}: `pip install -U torchao`"
    needs = TORCH_FOR_TORCHAO.get(".".join((version or "").split(".")[:2]))
    torch_version = installed_version("torch")
    if needs and torch_version and older_than(torch_version, needs):
        return (
            f"torchao {version} needs torch >= {needs} (found torch {torch_version}): `pip install 'torch>={needs}'`, "
            f"or the torchao built for your torch (`pip install 'torchao<{version}'`)"
        )
    return ""


@hookimpl
def describe_backend(hardware: HardwareInfo) -> BackendDescription:
    reason = unavailable_reason()
    # On sm_100+ MXFP8 is native only where torchao's kernels are there to run it (native_kernels).
    mxfp8_emulated = ("mxfp8",) if not reason and mxfp8_kernels_problem(hardware) else ()
    return BackendDescription(
        name=NAME,
        priority=PRIORITY,
        available=not reason,
        reason=reason,
        options_class=AORecipeKwargs,
        libraries=("torchao",),
        aliases=("torchao",),
        # Every recipe runs anywhere: FP8 GEMMs are emulated without sm_89, MXFP8 with torchao's
        # emulated kernels and NVFP4 with lowbit-ao's own emulation without sm_100.
        precisions=("fp8", "fp4"),
        recipes=RECIPE_NAMES,
        emulates=RECIPE_NAMES,
        # torchao's NVFP4Linear (triton, bf16, dims % 128, no recipe options) is not bound yet.
        emulated_only=("nvfp4", *mxfp8_emulated),
        # fp32 master weights, gradients and AdamW states; AdamWFp8 / AdamW8bit keep 1 byte per
        # state element plus a scale per 256-element block (bench/memory.py: 2.043 bytes per parameter).
        # A frozen base (LoRA's) is stored in FP8: 1 byte a weight (lowbit_ao.frozen_base; its scales,
        # one per tensor or per 128x128 block, are left out).
        memory_per_parameter={"optimizer_low_bit": 2.043, "frozen_linear": 1.0},
        recipe_costs=RECIPE_COSTS,
    )


@hookimpl
def check_compatibility(context: PrepareContext) -> None:
    from lowbit_ao.convert import check_compatibility as check

    check(context)


@hookimpl
def convert_model(model, context: PrepareContext, layer_roles):
    from lowbit_ao.convert import convert

    return convert(model, context, layer_roles)


@hookimpl
def wrap_optimizer(optimizer, model, context: PrepareContext):
    if context.backend_options.optimizer_states == "default":
        return None
    from lowbit_ao.optim import to_low_bit_optimizer

    return to_low_bit_optimizer(optimizer, context.backend_options.optimizer_states)


@hookimpl
def after_optimizer_step(model, optimizer, context: PrepareContext):
    from lowbit_ao.convert import after_step_work

    return after_step_work(model, context)


@hookimpl
def strategy_integration(strategy: str, context: PrepareContext):
    if context.parallelism is None or not context.parallelism.tp_enabled:
        return None
    from lowbit_ao.convert import tensor_parallel_style

    return StrategyIntegration(tensor_parallel_style=tensor_parallel_style)


@hookimpl
def enable_fp8_telemetry(model, recorder, context: PrepareContext):
    from lowbit_ao.telemetry import enable

    return enable(model, recorder, context.backend_options)


@hookimpl
def export_state_dict(model, state_dict, context: PrepareContext):
    from lowbit_ao.convert import plain_state_dict
    from lowbit_ao.frozen_layers import dequantized_state_dict

    return dequantized_state_dict(model, plain_state_dict(state_dict))


add_launch_arguments, launch_environment = recipe_launch_hooks(AORecipeKwargs, "fp8 backend ao (torchao)")
