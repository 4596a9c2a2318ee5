"""``AORecipeKwargs``: the torchao backend's options. Importing it does not import torchao."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from lowbit.config.recipes import RecipeKwargs, recipe_option

RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
OPTIMIZER_STATES = ("default", "fp8", "8bit")
EMULATIONS = ("fast", "torchao")


@dataclass
class AORecipeKwargs(RecipeKwargs):
    """Options of torchao float8 training, as in Accelerate's ``AORecipeKwargs`` plus lowbit's.

    config: a full ``torchao.float8.Float8LinearConfig``; wins over ``recipe``.
    module_filter_func: ``(module, fqn) -> bool``, which Linear layers to convert. Replaces the
        default rule (all Linears but the first and last, and those with dims not divisible by 16).
    """

    backend_name: ClassVar[str] = "ao"

    config: Any = recipe_option(None, code_only=True, help="a torchao Float8LinearConfig")
    module_filter_func: Callable[..., bool] | None = recipe_option(None, code_only=True, help="(module, fqn) -> bool")
    recipe: str | None = recipe_option("tensorwise", choices=RECIPE_NAMES, help="torchao recipe name")
    # On by default, as in Accelerate: CUDA's FP8 GEMM refuses an inner dim (the token count, in the
    # weight-gradient GEMM) that is not a multiple of 16.
    pad_inner_dim: bool | None = recipe_option(True, type=bool, help="pad GEMM inner dims (tokens too) to multiples of 16")
    enable_fsdp_float8_all_gather: bool | None = recipe_option(False, type=bool, help="FSDP2 all-gathers weights in float8")
    force_recompute_fp8_weight_in_bwd: bool | None = recipe_option(False, type=bool, help="recompute the fp8 weight in backward")
    keep_first_last_high_precision: bool | None = recipe_option(True, type=bool, help="keep the first and last Linear in high precision")
    emulate: bool | None = recipe_option(None, type=bool, help="emulate FP8 GEMMs (default: only where hardware lacks them)")
    emulation: str | None = recipe_option(
        "fast", choices=EMULATIONS,
        help="how FP8 GEMMs are emulated: fast (fp8 values multiplied in bf16/fp32, scales on the output) "
             "or torchao (torchao's emulate=True: dequantized, fp32)")
    optimizer_states: str | None = recipe_option("default", choices=OPTIMIZER_STATES, help="default, fp8 (AdamWFp8) or 8bit (AdamW8bit)")
