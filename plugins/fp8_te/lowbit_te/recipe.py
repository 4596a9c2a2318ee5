"""``TERecipeKwargs``: Transformer Engine options. Importing it does not import TE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lowbit.kernel.plugin_api import (
    ConfigError,
    FP4RecipeOptions,
    RecipeKwargs,
    at_least,
    recipe_name_option,
    recipe_option,
)

FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# TE's recipes, by their names in lowbit's vocabulary (lowbit.kernel.recipe_names), fp8 first.
RECIPE_NAMES = ("delayed", "current", "block", "mxfp8", "nvfp4")


@dataclass
class TERecipeKwargs(FP4RecipeOptions, RecipeKwargs):
    """Accelerate's ``TERecipeKwargs`` fields (same names and defaults), plus lowbit's.

    recipe: which TE recipe: delayed (``DelayedScaling``, Accelerate's), current
        (``Float8CurrentScaling``), block (``Float8BlockScaling``, sm_90+ with CUDA 12.9+),
        mxfp8 (``MXFP8BlockScaling``, sm_100+) or, under ``mixed_precision="fp4"``, nvfp4
        (``NVFP4BlockScaling``, TE 2.8+, sm_100+). ``scaling`` is accepted as its older name.
    use_mxfp8_block_scaling: Accelerate's switch for MXFP8; the same as ``recipe="mxfp8"``.
    te_recipe: a TE recipe object you built yourself; used as it is (code only).
    """

    backend_name: ClassVar[str] = "te"

    use_autocast_during_eval: bool | None = recipe_option(False, type=bool, help="keep FP8 autocast on in eval mode")
    margin: int | None = recipe_option(0, type=int, normalize=at_least(0), help="margin for the scaling factor")
    interval: int | None = recipe_option(
        1, type=int, normalize=at_least(1), help="steps between scaling-factor updates (TE 1.x only)"
    )
    fp8_format: str | None = recipe_option("HYBRID", choices=FP8_FORMATS, help="HYBRID, E4M3 or E5M2")
    amax_history_len: int | None = recipe_option(
        1024, type=int, normalize=at_least(1), help="length of the amax history window"
    )
    amax_compute_algo: str | None = recipe_option("most_recent", choices=AMAX_COMPUTE_ALGOS, help="max or most_recent")
    override_linear_precision: tuple[bool, bool, bool] | None = recipe_option(
        (False, False, False), type="bools3", help="(fprop, dgrad, wgrad) in high precision (TE 1.x only)"
    )
    recipe: str | None = recipe_name_option("delayed", help="delayed, current, block, mxfp8 (fp8); nvfp4 (fp4)")
    use_mxfp8_block_scaling: bool | None = recipe_option(
        False, type=bool, code_only=True, help="Accelerate's name for recipe='mxfp8'"
    )
    keep_first_last_high_precision: bool | None = recipe_option(
        False, type=bool, help="keep the first and last Linear in high precision"
    )
    te_recipe: Any = recipe_option(None, code_only=True, help="a transformer_engine.common.recipe object, used as is")
    # TE's FP8 GEMMs refuse token counts that are not multiples of 8 (32 for MXFP8): pad them.
    pad_tokens: bool | None = recipe_option(True, type=bool, help="pad odd token counts to what TE's FP8 GEMMs need")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.use_mxfp8_block_scaling:
            if self.recipe not in (None, "mxfp8"):
                raise ConfigError(
                    f"TERecipeKwargs got use_mxfp8_block_scaling=True and recipe={self.recipe!r}; "
                    "they contradict each other. Give recipe='mxfp8' alone."
                )
            self.recipe = "mxfp8"
