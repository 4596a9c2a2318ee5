"""``MSAMPRecipeKwargs``: MS-AMP's one option, the optimization level. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import ClassVar

from lowbit.kernel.plugin_api import ConfigError, RecipeKwargs, recipe_option

OPT_LEVELS = ("O1", "O2")


def check_opt_level(value: object) -> object:
    """Levels use the letter O. A zero ("01", "O0") is the classic typo: say so."""
    text = str(value).strip()
    if text[:1] == "0":
        raise ConfigError(
            f"opt_level {text!r} starts with a zero; MS-AMP levels use the letter O: did you mean 'O{text[1:]}'?"
        )
    if text[:1] in "oO" and text[1:] == "0":
        raise ConfigError(f"opt_level {text!r} does not exist; MS-AMP has O1 and O2 (letter O, then 1 or 2).")
    return text


@dataclass
class MSAMPRecipeKwargs(RecipeKwargs):
    """``opt_level``: "O1" (FP8 weight gradients and all-reduce) or "O2" (also FP8 first-order and
    FP16 second-order Adam states). Default "O2", on every path (DeepSpeed included).
    ``optimization_level`` is accepted as a synonym, as in Accelerate's docs."""

    backend_name: ClassVar[str] = "msamp"

    opt_level: str | None = recipe_option(
        "O2", choices=OPT_LEVELS, help="O1 or O2 (letter O)", normalize=check_opt_level
    )
    optimization_level: InitVar[str | None] = None

    def __post_init__(self, optimization_level: str | None = None) -> None:
        if optimization_level is not None:
            if self.opt_level is not None:
                raise ConfigError("Give opt_level or optimization_level, not both: they are the same option.")
            self.opt_level = optimization_level
        super().__post_init__()
