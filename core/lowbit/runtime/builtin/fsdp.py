"""Built-in strategy: FSDP2 (``torch.distributed.fsdp.fully_shard``), and with a ParallelismConfig
HSDP (a (dp_replicate, dp_shard) mesh), tensor parallelism and both together.

The order is torchtitan's: tensor parallelism first (on the mesh's ``tp`` dimension), then
activation checkpointing of each block, then the blocks are sharded one by one (auto-wrap by
module class), then the root, so that all-gathers of one block overlap compute of the previous one.
Mixed precision uses FSDP2's own ``MixedPrecisionPolicy``: parameters are gathered in the compute
dtype, gradients reduced in fp32. ``fully_shard`` moves each unit to the device as it shards it,
so the whole unsharded model is never on the device (``places_model``).
"""

from __future__ import annotations

import functools
from typing import Any

from lowbit.kernel.errors import ConfigError, did_you_mean
from lowbit.kernel.hookspecs import hookimpl
from lowbit.kernel.types import HardwareInfo, PrepareContext, StrategyDescription, StrategyMemory

from lowbit.runtime.builtin import sharded_state
from lowbit.runtime.builtin.activation_checkpointing import MODES as CHECKPOINT_MODES
from lowbit.runtime.builtin.activation_checkpointing import checkpoint_blocks
from lowbit.runtime.builtin.tensor_parallel import apply_tensor_parallel, tell_transformers_the_layout

NAME = "fsdp"
# Everything sharded; one block's parameters are whole while it computes, and unsharded gradients
# wait for reduce-scatters that run asynchronously (over gloo: all of them), so the peak is a range.
MEMORY = StrategyMemory(
    shards_weights=True,
    shards_gradients=True,
    shards_optimizer=True,
    buffers=("block", "gradients"),
    note="buffers: one unsharded block, and the unsharded gradients that wait for reduce-scatters "
    "running asynchronously, so buffers and peak are a range (none of them alive to all of "
    "them); measured on CPU within 15% of the range in fp32",
)
OPTIONS = {
    "transformer_layer_cls_to_wrap": "class names to shard as separate units (default: every item of each outermost "
    "nn.ModuleList, the blocks; lists inside a block, e.g. an MoE's experts, stay in it)",
    "reshard_after_forward": "free gathered parameters after forward (default true)",
    "activation_checkpointing": "recompute each block's activations in backward: false (default), true or 'full', "
    "or 'selective' (keep matmul outputs, recompute the rest)",
    "sync_module_states": "every rank's shards take rank 0's weights at prepare() (default false)",
    "cpu_ram_efficient_loading": "only local rank 0 of each machine loads a transformers checkpoint, the other "
    "ranks build the model on the meta device and receive rank 0's weights at prepare() (implies "
    "sync_module_states; lowbit launch exports what transformers reads for it)",
}


@hookimpl
def describe_backend(hardware: HardwareInfo) -> StrategyDescription:
    return StrategyDescription(
        name=NAME,
        priority=5,
        available=True,
        aliases=("fsdp2",),
        distributed_types=("FSDP",),
        reports_as="FSDP",
        config_section="fsdp_config",
        launch_flag="use_fsdp",
        checkpoint="own",
        memory={NAME: MEMORY},
        checkpoint_reshards=True,
        mesh_dims=("dp_replicate", "dp_shard", "cp", "tp"),
        places_model=True,
    )


def _check_options(options: dict[str, Any]) -> None:
    for key in options:
        if key not in OPTIONS:
            raise ConfigError(
                f"Unknown key {key!r} in fsdp_config.{did_you_mean(key, OPTIONS)} Valid keys: {', '.join(OPTIONS)}."
            )


def _units_to_shard(model, class_names: list[str] | None):
    import torch.nn as nn

    if class_names:
        wanted = set(class_names)
        units = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]  # each module once
        found = {type(m).__name__ for m in units}
        missing = wanted - found
        if missing:
            present = sorted({type(m).__name__ for m in model.modules()})
            name = sorted(missing)[0]
            raise ConfigError(
                f"fsdp_config.transformer_layer_cls_to_wrap names {name!r}, which is not in the model."
                f"{did_you_mean(name, present)} Module classes in the model: {', '.join(present)}."
            )
        return units
    # The blocks: items of the outermost lists only. A block's own lists (an MoE's experts) stay in
    # its unit: an expert no token reached on one rank runs no forward there, and as a unit of its
    # own it would leave that rank's collectives out of step with the others'.
    blocks: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(prefix) for prefix in inside):
            blocks.extend(module)
            inside.append(f"{name}.")
    # A block listed several times (ALBERT's shared layers) is one unit: fully_shard applies once per module.
    return list(dict.fromkeys(blocks))


@hookimpl
def check_compatibility(context: PrepareContext) -> None:
    _check_options(context.strategy_options)
    mode = context.strategy_options.get("activation_checkpointing", False)
    if mode not in CHECKPOINT_MODES:
        raise ConfigError(
            f"fsdp_config.activation_checkpointing {mode!r} is not one of "
            f"{', '.join(repr(m) for m in CHECKPOINT_MODES)}."
        )
    layout = context.parallelism
    if layout is not None and not (layout.dp_shard_enabled or layout.cp_enabled):
        raise ConfigError(
            "FSDP2 has no dimension to shard over: the ParallelismConfig has dp_shard_size and cp_size 1 (all "
            f"{context.world_size} processes are {', '.join(layout.active_mesh_dims) or 'one group'}). Give "
            "dp_shard_size "
            "> 1, or train without FSDP (e.g. tensor parallelism alone runs under distributed_type "
            "MULTI_GPU/MULTI_CPU)."
        )


def _fsdp_mesh(context: PrepareContext):
    """The mesh FSDP2 shards over: (dp_replicate, dp_shard_cp) for HSDP, else dp_shard_cp; None
    without a ParallelismConfig (FSDP2's default: every process)."""
    if context.parallelism is None:
        return None
    return context.device_mesh[tuple(context.parallelism.fsdp_dim_names)]


def gather_8bit_floats_as_stored(model) -> int:
    """Parameters stored in an 8-bit float format (a frozen FP8 base, a layer published in FP8) are
    all-gathered as stored, 1 byte an element: FSDP2's MixedPrecisionPolicy would cast them to the
    compute dtype like every floating parameter, turning FP8 data into numbers without their scales.
    FSDP2 has no per-parameter policy, so each such parameter's record (``FSDPParam``, torch 2.6 to
    2.13's ``_fsdp_param.py``) keeps ``param_dtype`` None ("gather in the stored dtype") after FSDP2
    sets it from the policy, once, at its lazy initialisation (the first forward). Returns how many."""
    told = 0
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            dtype = fsdp_param.sharded_param.dtype
            if dtype.is_floating_point and dtype.itemsize == 1:
                fsdp_param.init_dtype_attrs = functools.partial(_stored_dtype, fsdp_param.init_dtype_attrs, fsdp_param)
                if hasattr(fsdp_param, "param_dtype"):  # initialised already (a model prepared again)
                    fsdp_param.param_dtype = None
                told += 1
    return told


def _stored_dtype(init_dtype_attrs, fsdp_param, mp_policy) -> None:
    init_dtype_attrs(mp_policy)
    fsdp_param.param_dtype = None


@hookimpl
def wrap_for_distribution(model, optimizer, context: PrepareContext):
    if model is None:
        return model, optimizer
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lowbit.runtime.training import weights_from_rank0  # torch: only once FSDP is chosen

    options = context.strategy_options
    # Weights are gathered in the forward's compute dtype (bf16 for FP8 too, whose GEMMs run inside
    # bf16 autocast: half the bytes of fp32); torchao's float8 all-gather casts from the fp32 shard
    # whatever this says. Gradients are reduced in fp32.
    param_dtype = context.autocast_dtype
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    reshard = bool(options.get("reshard_after_forward", True))
    from_rank0 = bool(options.get("sync_module_states") or options.get("cpu_ram_efficient_loading"))
    if weights_from_rank0.unloaded_here(model) and not from_rank0:
        raise ConfigError(
            f"Rank {context.rank}'s model has weights on the meta device (transformers' cpu-RAM-efficient "
            "loading, or init_empty_weights), and FSDP2 would shard them as they are. Set "
            "fsdp_cpu_ram_efficient_loading (or fsdp_sync_module_states) so that prepare() fills them from rank 0."
        )
    # rank 0's whole tensors, taken before any layout splits them (tensor parallel, then FSDP2)
    whole = weights_from_rank0.whole_tensors(model) if from_rank0 and context.rank == 0 else None
    model = apply_tensor_parallel(model, context)
    units = _units_to_shard(model, options.get("transformer_layer_cls_to_wrap"))
    checkpoint_blocks(
        model, units, options.get("activation_checkpointing", False), context.strategy_integration.activation_checkpoint
    )
    mesh = _fsdp_mesh(context)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    gather_8bit_floats_as_stored(model)
    if from_rank0:
        weights_from_rank0.fill_shards(model, whole, context.device)
        del whole
    tell_transformers_the_layout(model, context)
    return model, optimizer


@hookimpl
def full_state_dict(model, context: PrepareContext):
    return sharded_state.full_state_dict(model)


@hookimpl
def save_checkpoint(directory: str, model, optimizer, context: PrepareContext):
    return sharded_state.save(directory, model, optimizer)


@hookimpl
def load_checkpoint(directory: str, model, optimizer, context: PrepareContext):
    return sharded_state.load(directory, model, optimizer)
