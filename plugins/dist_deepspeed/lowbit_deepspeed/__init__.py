"""lowbit-deepspeed: DeepSpeed ZeRO 0-3 as a lowbit distributed strategy.

``deepspeed`` is imported only inside the hooks that run once DeepSpeed has been chosen.
"""

from __future__ import annotations

import importlib.util
import json

from lowbit import hookimpl

from lowbit.kernel.plugin_api import (
    HardwareInfo,
    PrepareContext,
    StrategyDescription,
    StrategyMemory,
    UnsupportedCombinationError,
)

from lowbit_deepspeed.ds_config import SECTION_KEYS, check_section

NAME = "deepspeed"
# What each ZeRO stage shards (stage 3 gathers one block's parameters while it computes).
UNMEASURED = "not measured"
MEMORY = {
    "zero1": StrategyMemory(shards_optimizer=True, note=UNMEASURED),
    "zero2": StrategyMemory(shards_gradients=True, shards_optimizer=True, note=UNMEASURED),
    "zero3": StrategyMemory(
        shards_weights=True,
        shards_gradients=True,
        shards_optimizer=True,
        buffers=("block",),
        note="buffers: one unsharded block; " + UNMEASURED,
    ),
}
LAUNCH_FLAGS = (
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "gradient_clipping",
    "deepspeed_config_file",
)


@hookimpl
def describe_backend(hardware: HardwareInfo) -> StrategyDescription:
    found = importlib.util.find_spec("deepspeed") is not None
    # DeepSpeed applies fp16/bf16 itself (its config's sections) and writes its own checkpoints.
    return StrategyDescription(
        name=NAME,
        priority=20,
        available=found,
        reason="" if found else "deepspeed not installed: `pip install deepspeed`",
        aliases=("ds", "zero"),
        libraries=("deepspeed",),
        distributed_types=("DEEPSPEED",),
        reports_as="DEEPSPEED",
        config_section="deepspeed_config",
        owns_precision=True,
        launch_flag="use_deepspeed",
        checkpoint="own",
        memory=MEMORY,
    )


@hookimpl
def check_compatibility(context: PrepareContext) -> None:
    check_section(context.strategy_options)


@hookimpl
def wrap_for_distribution(model, optimizer, context: PrepareContext):
    from lowbit_deepspeed.engine import initialize

    return initialize(model, optimizer, context)


@hookimpl
def backward(loss, model, context: PrepareContext, options):
    from lowbit_deepspeed.engine import run_pending_step, run_state

    run_pending_step(context)  # a boundary step the script never took (no optimizer.step()) comes first
    boundary = model.is_gradient_accumulation_boundary()
    model.backward(loss, **options)  # e.g. scale_wrt_gas=False from transformers' Trainer, which divides itself
    if boundary:
        run_state(context).pending_step = model  # taken by optimizer.step() or clip_grad_norm_
    else:
        model.step()  # between boundaries DeepSpeed's step only counts the micro-step
    return True


@hookimpl
def clip_grad_norm(parameters, max_norm, norm_type, context: PrepareContext):
    from lowbit_deepspeed.engine import clip_and_step, run_state

    if float(norm_type) != 2.0:
        raise UnsupportedCombinationError(f"DeepSpeed clips gradients by their 2-norm only; got norm_type={norm_type}.")
    return clip_and_step(run_state(context).engine, max_norm, context)


@hookimpl
def full_state_dict(model, context: PrepareContext):
    from lowbit_deepspeed.engine import gathered_state_dict, run_pending_step

    run_pending_step(context)
    return gathered_state_dict(model, main=context.rank == 0)


@hookimpl
def save_checkpoint(directory, model, optimizer, context: PrepareContext):
    from lowbit_deepspeed.engine import run_pending_step

    run_pending_step(context)
    model.save_checkpoint(directory, tag="deepspeed")
    return True


@hookimpl
def load_checkpoint(directory, model, optimizer, context: PrepareContext):
    model.load_checkpoint(directory, tag="deepspeed")
    return True


@hookimpl
def add_launch_arguments(parser) -> None:
    group = parser.add_argument_group("DeepSpeed (lowbit-deepspeed), with --use_deepspeed")
    for key in LAUNCH_FLAGS:
        if f"--{key}" not in parser._option_string_actions:
            group.add_argument(f"--{key}", default=None, help=SECTION_KEYS[key])


@hookimpl
def launch_environment(args):
    section = {key: getattr(args, key) for key in LAUNCH_FLAGS if getattr(args, key, None) is not None}
    if not section:
        return None
    if "zero_stage" in section:
        section["zero_stage"] = (
            int(section["zero_stage"]) if str(section["zero_stage"]).isdigit() else section["zero_stage"]
        )
    check_section(section)
    return {"LOWBIT_DEEPSPEED_CONFIG": json.dumps(section)}
