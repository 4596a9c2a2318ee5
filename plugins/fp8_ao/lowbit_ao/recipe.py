"""``AORecipeKwargs``: the torchao backend's options. Importing it does not import torchao."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from lowbit.kernel.plugin_api import FP4RecipeOptions, RecipeKwargs, at_least, recipe_name_option, recipe_option

# The recipes lowbit-ao offers (lowbit.kernel.recipe_names), fp8 first: torchao.float8's three,
# MXFP8 through torchao's prototype MXFP8Linear, NVFP4 through torchao's NVFP4Linear on a
# Blackwell GPU with triton, and lowbit-ao's own emulation anywhere else.
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
BLOCK_RECIPES = ("mxfp8", "nvfp4")
RECIPE_NAMES = FLOAT8_RECIPES + BLOCK_RECIPES
# How an MXFP8 block's power-of-two scale is rounded: "floor" is the OCP MX v1.0 spec's
# (2^(floor(log2 amax) - 8)); "rceil" rounds amax/448 up to a power of two (torchao's default,
# ScaleCalculationMode.RCEIL, and what Blackwell's cast instructions do), so nothing saturates.
MX_SCALE_ROUNDINGS = ("rceil", "floor")
OPTIMIZER_STATES = ("default", "fp8", "8bit")
EMULATIONS = ("fast", "torchao")
# What becomes of a frozen base (a Linear whose weight needs no gradient, as under LoRA): lowbit_ao.frozen_base.
FROZEN_BASES = ("fp8", "high_precision")
# "auto" also keeps in high precision the layers lowbit's FP8 payoff prediction finds no faster in
# the recipe on the run's GPU (lowbit.runtime.observe.fp8_payoff; docs/fp8-payoff.md).
LAYER_FILTERS = ("default", "auto")


@dataclass
class AORecipeKwargs(FP4RecipeOptions, RecipeKwargs):
    """Options of torchao float8 training, as in Accelerate's ``AORecipeKwargs`` plus lowbit's.

    config: a full ``torchao.float8.Float8LinearConfig``; wins over ``recipe``.
    module_filter_func: ``(module, fqn) -> bool``, which Linear layers to convert. Replaces the
        default rule (all Linears but the first and last, and those with dims not divisible by 16).
    """

    backend_name: ClassVar[str] = "ao"

    config: Any = recipe_option(None, code_only=True, help="a torchao Float8LinearConfig")
    module_filter_func: Callable[..., bool] | None = recipe_option(None, code_only=True, help="(module, fqn) -> bool")
    recipe: str | None = recipe_name_option(
        "tensorwise", help="tensorwise, rowwise, rowwise_with_gw_hp, mxfp8 (fp8); nvfp4 (fp4)"
    )
    mx_scale_rounding: str | None = recipe_option(
        "rceil", choices=MX_SCALE_ROUNDINGS, help="mxfp8 block scales: rceil or floor (OCP spec)"
    )
    # On by default, as in Accelerate: CUDA's FP8 GEMM refuses an inner dim (the token count, in the
    # weight-gradient GEMM) that is not a multiple of 16.
    pad_inner_dim: bool | None = recipe_option(
        True, type=bool, help="pad GEMM inner dims (tokens too) to multiples of 16"
    )
    # Unset: on under FSDP2 with tensorwise weight scales (as Accelerate's default Float8LinearConfig),
    # off elsewhere; torchao gathers tensorwise-scaled weights only.
    enable_fsdp_float8_all_gather: bool | None = recipe_option(
        None, type=bool, help="FSDP2 all-gathers weights in float8 (default: on under FSDP2 with recipe tensorwise)"
    )
    force_recompute_fp8_weight_in_bwd: bool | None = recipe_option(
        False, type=bool, help="recompute the fp8 weight in backward"
    )
    layer_filter: str | None = recipe_option(
        "default",
        choices=LAYER_FILTERS,
        help="default (first/last Linear and dims not divisible by 16 stay high precision) or auto "
        "(also the layers predicted no faster in the recipe on this GPU)",
    )
    layer_filter_tokens: int | None = recipe_option(
        8192,
        type=int,
        normalize=at_least(1),
        help="tokens per micro-batch the auto layer filter assumes (default 8192)",
    )
    keep_first_last_high_precision: bool | None = recipe_option(
        True, type=bool, help="keep the first and last Linear in high precision"
    )
    frozen_bases: str | None = recipe_option(
        "fp8",
        choices=FROZEN_BASES,
        help="Linears whose weight needs no gradient (LoRA bases): fp8 (stored in FP8 once, two FP8 GEMMs a step, "
        "none for the weight) or high_precision (left as they are)",
    )
    emulate: bool | None = recipe_option(
        None, type=bool, help="emulate FP8 GEMMs (default: only where hardware lacks them)"
    )
    emulation: str | None = recipe_option(
        "fast",
        choices=EMULATIONS,
        help="how FP8 GEMMs are emulated: fast (fp8 values multiplied in bf16/fp32, scales on the output) "
        "or torchao (torchao's emulate=True: dequantized, fp32)",
    )
    optimizer_states: str | None = recipe_option(
        "default", choices=OPTIMIZER_STATES, help="default, fp8 (AdamWFp8) or 8bit (AdamW8bit)"
    )
