"""``TERecipeKwargs``: Transformer Engine options. Importing it does not import TE."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lowbit.config.recipes import RecipeKwargs, recipe_option

FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# TE scaling recipes, by the short name lowbit accepts.
SCALINGS = ("delayed", "current", "mxfp8", "block")


@dataclass
class TERecipeKwargs(RecipeKwargs):
    """Accelerate's ``TERecipeKwargs`` fields (same names and defaults), plus lowbit's.

    scaling: which TE scaling recipe: delayed (``DelayedScaling``, Accelerate's), current
        (``Float8CurrentScaling``), mxfp8 (``MXFP8BlockScaling``, sm_100+) or block
        (``Float8BlockScaling``).
    te_recipe: a TE recipe object you built yourself; used as it is (code only).
    """

    backend_name: ClassVar[str] = "te"

    use_autocast_during_eval: bool | None = recipe_option(False, type=bool, help="keep FP8 autocast on in eval mode")
    margin: int | None = recipe_option(0, type=int, help="margin for the scaling factor")
    interval: int | None = recipe_option(1, type=int, help="steps between scaling-factor updates (TE 1.x only)")
    fp8_format: str | None = recipe_option("HYBRID", choices=FP8_FORMATS, help="HYBRID, E4M3 or E5M2")
    amax_history_len: int | None = recipe_option(1024, type=int, help="length of the amax history window")
    amax_compute_algo: str | None = recipe_option("most_recent", choices=AMAX_COMPUTE_ALGOS, help="max or most_recent")
    override_linear_precision: tuple[bool, bool, bool] | None = recipe_option(
        (False, False, False), type="bools3", help="(fprop, dgrad, wgrad) in high precision (TE 1.x only)"
    )
    scaling: str | None = recipe_option("delayed", choices=SCALINGS, help="scaling recipe: delayed, current, mxfp8 or block")
    keep_first_last_high_precision: bool | None = recipe_option(False, type=bool, help="keep the first and last Linear in high precision")
    te_recipe: Any = recipe_option(None, code_only=True, help="a transformer_engine.common.recipe object, used as is")
    # TE's FP8 GEMMs refuse token counts that are not multiples of 8 (32 for MXFP8): pad them.
    pad_tokens: bool | None = recipe_option(True, type=bool, help="pad odd token counts to what TE's FP8 GEMMs need")
