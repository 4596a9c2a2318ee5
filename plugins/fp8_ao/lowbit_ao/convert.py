"""Model conversion with torchao float8: which Linears, which config, emulation or not."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Callable

import torch
from torch import nn

from lowbit.kernel.plugin_api import (
    BackendUnavailableError,
    ConfigError,
    ConversionReport,
    ConvertedModel,
    LayerRole,
    LayerRoles,
    LowbitNote,
    PrepareContext,
    UnsupportedCombinationError,
    note,
)

from lowbit_ao.conv1d import convert_conv1d_layers, is_conv1d, linear_dims
from lowbit_ao.fast_emulation import compute_dtype_for, mark_converted_layers
from lowbit_ao.frozen_layers import FrozenConversion, convert_frozen_layers
from lowbit_ao.gemm_rules import SCALED_MM_MULTIPLE
from lowbit_ao.quiet_import import import_torchao
from lowbit_ao.recipe import BLOCK_RECIPES

# Options of torchao's float8 recipes that a block-scaled recipe has no use for.
FLOAT8_ONLY_OPTIONS = ("enable_fsdp_float8_all_gather", "force_recompute_fp8_weight_in_bwd")

# FP8 GEMMs need both dims of a weight to be multiples of 16 (CUDA's _scaled_mm: gemm_rules).
FP8_DIM_MULTIPLE = SCALED_MM_MULTIPLE
# What pad_inner_dim does, for the FP8 report.
PADDING_NOTE = (
    "GEMM inner dims (incl. the token count in weight-gradient GEMMs) padded to multiples of 16 "
    "where needed (pad_inner_dim)"
)


class EmulationNotice(LowbitNote):
    """Raised once when FP8 GEMMs are emulated because the hardware lacks them."""


def _float8_types():
    import_torchao()
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import CastConfig, Float8GemmConfig

    return Float8LinearConfig, CastConfig, Float8GemmConfig


def validate_float8_config(config: Any) -> None:
    """Check a user's Float8LinearConfig field by field; torchao itself does not check types."""
    Float8LinearConfig, CastConfig, Float8GemmConfig = _float8_types()
    if not isinstance(config, Float8LinearConfig):
        raise ConfigError(
            f"AORecipeKwargs(config=...) expects a torchao.float8.Float8LinearConfig, got {type(config).__name__}."
        )
    hints = typing.get_type_hints(Float8LinearConfig)
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        hint = hints.get(field.name)
        allowed = typing.get_args(hint) or (hint,)
        allowed = tuple(t for t in allowed if isinstance(t, type))
        if not allowed or value is None and type(None) in allowed:
            continue
        if not isinstance(value, allowed) or (bool in allowed and not isinstance(value, bool)):
            expected = " or ".join(t.__name__ for t in allowed)
            raise ConfigError(
                f"Float8LinearConfig.{field.name} expects {expected}, got {value!r} ({type(value).__name__})."
            )


def build_float8_config(options: Any, context: PrepareContext) -> Any:
    """The Float8LinearConfig to use: the user's (checked) or the named recipe, plus lowbit's options."""
    Float8LinearConfig, _, _ = _float8_types()
    if options.config is not None:
        validate_float8_config(options.config)
        config = options.config
    else:
        config = Float8LinearConfig.from_recipe_name(options.recipe)  # a float8 recipe: block ones never get here
    overrides = {
        name: True
        for name in ("pad_inner_dim", "force_recompute_fp8_weight_in_bwd")
        # a Float8LinearConfig the user built keeps its own values, unless the option was given too
        if getattr(options, name) and (options.config is None or not options.is_default(name))
    }
    overrides["enable_fsdp_float8_all_gather"] = gathers_in_fp8(options, config, context)
    hardware = context.hardware
    needs_emulation = not hardware.has_fp8_gemm
    if options.emulate is False and needs_emulation:
        _check_scaled_mm_can_run(context)
    emulate = needs_emulation if options.emulate is None else options.emulate
    if emulate and options.emulate is None and not config.emulate:
        note(
            f"{hardware.describe()} has no FP8 GEMMs, so lowbit-ao emulates them: "
            f"{emulation_summary(options, context)}.",
            EmulationNotice,
        )
    overrides["emulate"] = emulate
    return dataclasses.replace(config, **overrides)


# torchao's named float8 recipes (Float8LinearConfig.from_recipe_name), by the name lowbit's report gives them.
FLOAT8_RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def recipe_of_config(config: Any) -> str:
    """The named recipe a user's Float8LinearConfig scales as (Accelerate's way of asking for
    rowwise: ``Float8LinearConfig.from_recipe_name("rowwise")``): the one whose six cast settings
    it shares; "Float8LinearConfig" when it matches none (its own mix of scalings)."""
    Float8LinearConfig, _, _ = _float8_types()
    casts = [f.name for f in dataclasses.fields(Float8LinearConfig) if f.name.startswith("cast_config")]

    def scaling(c: Any) -> tuple:
        return tuple(getattr(c, name) for name in casts)

    return next(
        (name for name in FLOAT8_RECIPE_NAMES if scaling(Float8LinearConfig.from_recipe_name(name)) == scaling(config)),
        "Float8LinearConfig",
    )


def gathers_in_fp8(options: Any, config: Any, context: PrepareContext) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8: as asked, else (unset) on under
    FSDP2 when the weights are scaled per tensor (a user's Float8LinearConfig keeps its own value)."""
    if options.enable_fsdp_float8_all_gather is not None:
        return options.enable_fsdp_float8_all_gather
    if options.config is not None:
        return config.enable_fsdp_float8_all_gather
    return context.strategy == "fsdp" and options.recipe == "tensorwise"


def emulation_summary(options: Any, context: PrepareContext) -> str:
    """How the FP8 GEMMs are emulated, in words (for the notice and the docs' examples)."""
    if options.emulation == "torchao":
        return "torchao's emulation (emulation='torchao': operands dequantized to fp32, fp32 GEMMs)"
    dtype = str(compute_dtype_for(context.device)).removeprefix("torch.")
    return (
        f"the exact fp8 values multiplied in {dtype}, scales applied to the output (emulation='fast'; "
        "emulation='torchao' for torchao's own)"
    )


def _check_scaled_mm_can_run(context: PrepareContext) -> None:
    """emulate=False: real FP8 GEMMs through torch._scaled_mm. On a CPU that is torch's reference
    kernel (measured on a 2-core x86 CPU: about as fast as torchao's emulation, 10-20% slower than
    lowbit's fast emulation in fp32); a CUDA GPU below sm_89 has no kernel at all."""
    if context.hardware.device_type != "cpu":
        raise BackendUnavailableError(
            f"emulate=False asks for real FP8 GEMMs, which need a CUDA GPU with compute capability >= 8.9; "
            f"found {context.hardware.describe()}. Leave emulate unset (lowbit emulates where needed) or set "
            "emulate=True."
        )
    note(
        f"emulate=False on {context.hardware.describe()}: torch._scaled_mm runs lowbit-ao's FP8 GEMMs "
        "(torch's CPU reference kernel, the numerics lowbit's fast emulation is tested against; "
        "not faster than emulation, see plugins/fp8_ao/README.md).",
        EmulationNotice,
    )


def linear_layers(model: nn.Module, roles: LayerRoles | None = None) -> dict[str, str]:
    """The layers FP8 can take, in module order: nn.Linear and transformers' Conv1D, name -> type
    name; never an adapter, nor a layer published in FP8 already (``roles``)."""
    own = (LayerRole.TRAINED, LayerRole.FROZEN_BASE)
    return {
        name: type(module).__name__
        for name, module in model.named_modules()
        if (isinstance(module, nn.Linear) or is_conv1d(module)) and (roles is None or roles.of(name) in own)
    }


def default_skips(model: nn.Module, keep_first_last: bool, roles: LayerRoles | None = None) -> dict[str, str]:
    """The model's first and last Linear (by module order, at any depth; adapters not counted), with the reason."""
    layers = linear_layers(model, roles)
    names = list(layers)
    skipped: dict[str, str] = {}
    if keep_first_last and names:
        skipped[names[0]] = f"first {layers[names[0]]} kept in high precision"
        skipped[names[-1]] = f"last {layers[names[-1]]} kept in high precision"
    return skipped


def auto_skips(
    model: nn.Module, options: Any, context: PrepareContext, skipped: dict[str, str], roles: LayerRoles | None = None
) -> dict[str, str]:
    """``layer_filter="auto"``: the layers not yet ``skipped`` that lowbit's FP8 payoff prediction
    finds no faster in the recipe on this run's GPU, with the prediction as the reason."""
    if options.layer_filter != "auto":
        return {}
    modules = dict(model.named_modules())
    shapes = {name: linear_dims(modules[name]) for name in linear_layers(model, roles) if name not in skipped}
    shapes = {
        name: dims for name, dims in shapes.items() if not (dims[0] % FP8_DIM_MULTIPLE or dims[1] % FP8_DIM_MULTIPLE)
    }
    from lowbit_ao.costs import RECIPE_COSTS

    if options.recipe not in RECIPE_COSTS:
        raise ConfigError(
            f"layer_filter='auto' has no prediction for recipe={options.recipe!r}: lowbit-ao runs it emulated "
            f"on every GPU. Recipes it predicts: {', '.join(RECIPE_COSTS)}; or leave layer_filter at 'default'."
        )
    return context.predict_slower_layers(
        shapes,
        options.layer_filter_tokens,
        context.hardware.device_name,
        options.recipe,
        RECIPE_COSTS[options.recipe],
        context.compiled,
    )


def default_module_filter(
    model: nn.Module,
    keep_first_last: bool,
    also_skip: dict[str, str] | None = None,
    roles: LayerRoles | None = None,
) -> tuple[Callable[[nn.Module, str], bool], dict[str, str]]:
    """All Linears (and Conv1Ds), but adapters, the model's first and last (by module order, at any
    depth), those whose dims FP8 GEMMs cannot take, and ``also_skip``. Returns the filter and the
    reason for each layer it skips (adapters are not listed: they are never candidates)."""
    layers = linear_layers(model, roles)
    names = list(layers)
    skipped = default_skips(model, keep_first_last, roles) | (also_skip or {})
    modules = dict(model.named_modules())
    for name in names:
        if name not in skipped:
            in_features, out_features = linear_dims(modules[name])
            if in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE:
                skipped[name] = f"dims {in_features}x{out_features} not divisible by {FP8_DIM_MULTIPLE}"

    def module_filter(module: nn.Module, fqn: str) -> bool:
        return fqn in layers and fqn not in skipped

    return module_filter, skipped


class EagerNotice(LowbitNote):
    """Said once when torchao's float8 trains on a GPU without torch.compile."""


def check_compatibility(context: PrepareContext) -> None:
    options = context.backend_options
    if context.device.type == "cuda" and not context.compiled:
        # Eager, each cast (amax, scale, convert, transpose) is a kernel of its own and reads the
        # tensor again; torchao's speedups are measured compiled, where they fuse into the GEMM's neighbours.
        note(
            "torchao float8 runs without torch.compile here: its casts run as separate kernels, so expect it to be "
            "no faster than bf16, often slower. Compile for the speedup: dynamo_backend='inductor', or "
            "TorchDynamoPlugin(backend='inductor', use_regional_compilation=True) to compile each block once "
            "(`lowbit fp8-payoff MODEL ... --eager` predicts both ways).",
            EagerNotice,
        )
    if options.recipe in BLOCK_RECIPES:
        given = [name for name in FLOAT8_ONLY_OPTIONS if not options.is_default(name) and getattr(options, name)]
        if options.config is not None or given:
            what = (
                "config=Float8LinearConfig(...)"
                if options.config is not None
                else ", ".join(f"{n}=True" for n in given)
            )
            raise UnsupportedCombinationError(
                f"{what} belongs to torchao's float8 recipes (tensorwise, rowwise); recipe={options.recipe!r} is a "
                "block-scaled format that does not use it. Remove it, or choose a float8 recipe."
            )
    if options.enable_fsdp_float8_all_gather and options.config is None and options.recipe != "tensorwise":
        raise UnsupportedCombinationError(
            f"enable_fsdp_float8_all_gather=True needs weights scaled per tensor (recipe='tensorwise'); torchao "
            f"cannot gather recipe={options.recipe!r}'s row-scaled weights in float8. Use recipe='tensorwise', or "
            "leave enable_fsdp_float8_all_gather unset (then FSDP2 gathers these weights in high precision)."
        )
    if options.config is None and options.recipe == "rowwise_with_gw_hp" and context.device.type != "cuda":
        raise UnsupportedCombinationError(
            "torchao's 'rowwise_with_gw_hp' recipe reads the autocast dtype only on CUDA, so its high-precision "
            f"grad-weight GEMM mixes bf16 and fp32 on {context.hardware.describe()}. Use recipe='tensorwise' or "
            "'rowwise' here, or run on a CUDA GPU."
        )


def _mxfp8_kernels_problem(context: PrepareContext) -> str:
    """Why torchao's native MXFP8 kernels do not run this run, or '' (also below sm_100, where MXFP8
    is emulated by the recipe's own hardware rule). A run planned as native whose kernels turn out
    missing once torchao is imported falls back to the emulated ones."""
    from lowbit_ao.native_kernels import mxfp8_kernels_problem, mxfp8_op_problem

    problem = mxfp8_kernels_problem(context.hardware)
    if not problem and context.recipe_runs == "native":
        import_torchao("torchao.prototype.mx_formats.kernels")
        problem = mxfp8_op_problem()
    return problem


def convert_block_recipe(
    model: nn.Module, context: PrepareContext, roles: LayerRoles, frozen: FrozenConversion
) -> ConvertedModel:
    """mxfp8 / nvfp4: the block-scaled layers (``block_formats``), with the same default rules."""
    from lowbit_ao.block_formats import convert_block_layers

    options = context.backend_options
    layer_types = linear_layers(model, roles)
    if options.module_filter_func is not None:
        modules = dict(model.named_modules())
        skipped = {
            n: "module_filter_func said no" for n in layer_types if not options.module_filter_func(modules[n], n)
        }
    else:
        skipped = default_skips(model, options.keep_first_last_high_precision, roles)
        skipped |= auto_skips(model, options, context, skipped, roles)
    skipped |= frozen.kept
    layer_types = {n: t for n, t in layer_types.items() if n not in frozen.converted}
    kernels = _mxfp8_kernels_problem(context) if options.recipe == "mxfp8" else ""
    planned = context.recipe_runs
    if kernels:  # this run's truth: the GEMMs below and the FP8 report (through the report) follow it
        context = dataclasses.replace(context, recipe_runs="emulated")
    if context.recipe_runs == "emulated":
        how = (
            "torchao's emulated MX kernels (values and scales as on the GPU, GEMMs in fp32)"
            if options.recipe == "mxfp8"
            else "lowbit-ao's NVFP4 emulation (values and scales as NVIDIA's format, GEMMs in fp32)"
        )
        native = (
            ""
            if options.recipe == "mxfp8"
            else " (lowbit-ao binds no native NVFP4 kernel; lowbit-te does, on Blackwell)"
        )
        native = f" ({kernels})" if kernels else native
        note(f"{options.recipe} runs emulated on {context.hardware.describe()}{native}: {how}.", EmulationNotice)
    converted = convert_block_layers(model, list(layer_types), skipped, context)
    return ConvertedModel(
        model,
        frozen.reported(
            ConversionReport(
                converted,
                skipped,
                layer_types,
                options.recipe,
                f"token count padded to a multiple of the {options.recipe} block where needed" if converted else "",
                recipe_runs=context.recipe_runs if context.recipe_runs != planned else None,
            )
        ),
    )


def frozen_candidates(model: nn.Module, options: Any, roles: LayerRoles) -> dict[str, str]:
    """The frozen bases the rules keep in high precision, with the reason: the first/last rule and
    a user's module_filter_func apply to them as to trained layers (dims are checked on conversion)."""
    if options.module_filter_func is not None:
        return {
            name: "module_filter_func said no"
            for name in roles.named(LayerRole.FROZEN_BASE)
            if not options.module_filter_func(model.get_submodule(name), name)
        }
    return default_skips(model, options.keep_first_last_high_precision, roles)


def convert(model: nn.Module, context: PrepareContext, layer_roles: LayerRoles | None = None) -> ConvertedModel:
    from lowbit.kernel.layer_roles import classify_layers

    options = context.backend_options
    if options.layer_filter == "auto" and (options.config is not None or options.module_filter_func is not None):
        raise ConfigError(
            "layer_filter='auto' decides which layers convert by the named recipe; it cannot combine with "
            f"{'config=' if options.config is not None else 'module_filter_func='}. Give one of the two."
        )
    roles = layer_roles if layer_roles is not None else classify_layers(model)
    recipe = options.recipe if options.config is None else recipe_of_config(options.config)
    frozen = convert_frozen_layers(model, roles, recipe, frozen_candidates(model, options, roles), context)
    if options.recipe in BLOCK_RECIPES and options.config is None:
        return convert_block_recipe(model, context, roles, frozen)
    import_torchao()
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = build_float8_config(options, context)
    if options.module_filter_func is not None:
        user_filter = options.module_filter_func
        trained = set(linear_layers(model, roles)) - set(frozen.kept)

        def module_filter(module: nn.Module, fqn: str) -> bool:
            return fqn in trained and user_filter(module, fqn)

        skipped = dict(frozen.kept)
    else:
        first_last = default_skips(model, options.keep_first_last_high_precision, roles)
        module_filter, skipped = default_module_filter(
            model,
            options.keep_first_last_high_precision,
            auto_skips(model, options, context, first_last, roles) | frozen.kept,
            roles,
        )
    layer_types = {n: t for n, t in linear_layers(model, roles).items() if n not in frozen.converted}
    uneven = uneven_shards(model, module_filter, context) if config.enable_fsdp_float8_all_gather else {}
    if uneven:
        # torchao's float8 all-gather needs every rank's shard the same size (pytorch/ao#3982): these
        # layers train in float8 too, but FSDP2 gathers their weights in high precision.
        note(
            f"FSDP2 gathers {len(uneven)} layer(s) in high precision, not float8: their weights' first dimension "
            f"does not divide by the number of shards ({', '.join(f'{n} {d}' for n, d in uneven.items())})."
        )
        plain = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
        model = convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in uneven, config=plain)
        model = convert_conv1d_layers(model, lambda m, fqn: fqn in uneven, plain)
    model = convert_to_float8_training(
        model, module_filter_fn=lambda m, fqn: module_filter(m, fqn) and fqn not in uneven, config=config
    )
    model = convert_conv1d_layers(model, lambda m, fqn: module_filter(m, fqn) and fqn not in uneven, config)
    if config.emulate or context.device.type != "cuda":
        # Off a real FP8 GPU, hold every GEMM to CUDA's shape rule, and emulate the fast way.
        fast = config.emulate and options.emulation == "fast"
        mark_converted_layers(model, compute_dtype_for(context.device) if fast else None)
    converted = [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
    # Which layers are FP8, why the others are not, and each one's type (for the report's wording).
    gathered = gathered_in_fp8(model) if config.enable_fsdp_float8_all_gather else None
    context.plugin_state(Float8Gather).on |= bool(gathered)
    return ConvertedModel(
        model,
        frozen.reported(
            ConversionReport(
                converted,
                skipped,
                layer_types,
                recipe,
                PADDING_NOTE if converted and config.pad_inner_dim else "",
                gathered,
            )
        ),
    )


def uneven_shards(
    model: nn.Module, module_filter: Callable[[nn.Module, str], bool], context: PrepareContext
) -> dict[str, int]:
    """The layers to convert whose weight FSDP2 would shard unevenly (dim 0 not divisible by the
    ranks), with that dimension. Under a ParallelismConfig FSDP2 shards over dp_shard x cp, after
    tensor parallelism may have split dim 0 by tp already (counted for every layer: a safe side)."""
    layout = context.parallelism
    parts = layout.dp_shard_size * layout.cp_size * layout.tp_size if layout is not None else context.world_size
    return {
        name: module.weight.shape[0]
        for name, module in model.named_modules()
        if (isinstance(module, nn.Linear) or is_conv1d(module))
        and module_filter(module, name)
        and module.weight.shape[0] % max(parts, 1)
    }


def gathered_in_fp8(model: nn.Module) -> list[str]:
    """The layers whose weights FSDP2 all-gathers in float8 (torchao wraps them for it)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), nn.Parameter)
        and isinstance(getattr(module.weight, "_local_tensor", module.weight), WeightWithDynamicFloat8CastTensor)
    ]


@dataclasses.dataclass
class Float8Gather:
    """This run's: whether any converted weight is all-gathered in float8 (decided at conversion)."""

    on: bool = False


def after_step_work(model: nn.Module, context: PrepareContext) -> Callable[[], None] | None:
    """torchao's float8 all-gather uses each weight's scale precomputed once per step, together
    (one all-reduce): that runs after every step (and after load_state) when the all-gather is in
    float8; no other run has work after a step."""
    if context.strategy == "fsdp" and context.plugin_state(Float8Gather).on:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        return functools.partial(precompute_float8_dynamic_scale_for_fsdp, model)
    return None


def tensor_parallel_style(module: nn.Module, style: str) -> Any:
    """torchao's float8 layout for a converted layer with tensorwise scaling: the input is cast to
    float8 before the collective, so the all-gather moves float8. None (torch's plain layout) for any
    other layer; rowwise-scaled layers take the plain one too (torchao's float8 styles scale per tensor,
    as torchtitan pairs them)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    if (
        not isinstance(module, Float8Linear)
        or module.config.cast_config_input.scaling_granularity != ScalingGranularity.TENSORWISE
    ):
        return None
    from torch.distributed.tensor import Replicate
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    styles = {
        "colwise": Float8ColwiseParallel,
        "rowwise": Float8RowwiseParallel,
        "colwise_gather_output": lambda: Float8ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: Float8ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: Float8RowwiseParallel(output_layouts=Replicate()),
    }
    return styles[style]() if style in styles else None


def plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Unwrap torchao's weight subclasses (float8 all-gather) into plain tensors."""
    out = {}
    for key, value in state_dict.items():
        while (
            isinstance(value, torch.Tensor)
            and type(value) not in (torch.Tensor, nn.Parameter)
            and hasattr(value, "_tensor")
        ):
            value = value._tensor
        out[key] = value
    return out
