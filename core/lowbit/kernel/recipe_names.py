"""The recipe vocabulary: one name per number format and scaling, whichever backend implements it.

A user names the recipe (``recipe="mxfp8"`` in any backend's recipe kwargs or in
``FP8RecipeKwargs``, ``fp8_config.recipe`` in YAML, ``lowbit launch --fp8_recipe``) and lowbit
maps it to an installed backend that offers it (``BackendDescription.recipes``). Each name says
which ``mixed_precision`` it trains in, so 4-bit recipes live under ``mixed_precision="fp4"``.

Hardware figures: FP8 tensor-core GEMMs from sm_89 (Ada); rowwise-scaled FP8 GEMMs have sm_89
kernels in torch (``aten/src/ATen/native/cuda/RowwiseScaledMMSM89.cu``); TE's block scaling
needs sm_90 and CUDA 12.9 (TE 2.20.2 ``pytorch/quantization.py``, ``_compute_fp8_block_scaling_support``);
MXFP8 and NVFP4 GEMMs exist on Blackwell (sm_100) only.
"""

from __future__ import annotations

from typing import Iterable

from lowbit.kernel.errors import ConfigError, did_you_mean
from lowbit.kernel.types import MXFP8_MIN_CAPABILITY, BackendDescription, RecipeInfo, normalize_name

STANDARD_RECIPES: dict[str, RecipeInfo] = {
    info.name: info
    for info in (
        RecipeInfo("tensorwise", "fp8", "E4M3/E5M2 values, one fp32 scale per tensor from its current amax"),
        RecipeInfo("rowwise", "fp8", "E4M3 values, one fp32 scale per row (token or output channel)"),
        RecipeInfo("rowwise_with_gw_hp", "fp8", "rowwise, with the weight-gradient GEMM in high precision"),
        RecipeInfo("delayed", "fp8", "E4M3/E5M2 values, per-tensor scales from an amax history (delayed scaling)"),
        RecipeInfo("current", "fp8", "E4M3/E5M2 values, per-tensor scales from the current amax"),
        RecipeInfo(
            "block",
            "fp8",
            "E4M3 values, fp32 scales per 1x128 (activations, gradients) and 128x128 (weights) block",
            block=128,
            min_capability=(9, 0),
            min_cuda=(12, 9),
        ),
        RecipeInfo(
            "mxfp8",
            "fp8",
            "E4M3 values, one power-of-two (E8M0) scale per 32 elements (OCP MX)",
            block=32,
            min_capability=MXFP8_MIN_CAPABILITY,
        ),
        RecipeInfo(
            "nvfp4",
            "fp4",
            "E2M1 values, one E4M3 scale per 16 elements and an fp32 scale per tensor",
            block=16,
            min_capability=MXFP8_MIN_CAPABILITY,
        ),
    )
}

# Other spellings users bring with them: TE's recipe class names, torchao's, Accelerate's.
RECIPE_SYNONYMS = {
    "delayedscaling": "delayed",
    "float8currentscaling": "current",
    "currentscaling": "current",
    "float8blockscaling": "block",
    "blockwise": "block",
    "mxfp8blockscaling": "mxfp8",
    "mx": "mxfp8",
    "nvfp4blockscaling": "nvfp4",
    "tensor": "tensorwise",
    "row": "rowwise",
}


def declared_recipes(description: BackendDescription) -> dict[str, RecipeInfo]:
    """A backend's recipes by name, in its order (names resolved through the vocabulary)."""
    out: dict[str, RecipeInfo] = {}
    for entry in description.recipes:
        info = entry if isinstance(entry, RecipeInfo) else STANDARD_RECIPES.get(entry)
        if info is not None:
            out[info.name] = info
    return out


def known_recipes(descriptions: Iterable[BackendDescription] = ()) -> dict[str, RecipeInfo]:
    """lowbit's vocabulary plus what the given backends declare of their own."""
    known = dict(STANDARD_RECIPES)
    for description in descriptions:
        for name, info in declared_recipes(description).items():
            known.setdefault(name, info)
    return known


def canonical_recipe(value: str, where: str = "recipe", declared: Iterable[RecipeInfo] = ()) -> str:
    """The vocabulary name for ``value`` ("MXFP8BlockScaling" -> "mxfp8"), or a ConfigError naming
    the nearest valid one. ``declared``: recipes of a plugin's own it accepts too (the caller
    knows them: the choice asks the installed plugins, a backend's options class names its own)."""
    known = {**STANDARD_RECIPES, **{info.name: info for info in declared}}
    by_key = {normalize_name(name): name for name in known}
    wanted = normalize_name(value)
    name = by_key.get(wanted) or RECIPE_SYNONYMS.get(wanted)
    if name in known:
        return name
    raise ConfigError(
        f"{where}: unknown recipe {value!r}.{did_you_mean(str(value), known)} "
        f"Recipes: {', '.join(known)} (`lowbit plugins` shows which backend offers which)."
    )


def recipe_status(description: BackendDescription, name: str, hardware) -> str:
    """How ``description``'s backend runs recipe ``name`` on ``hardware``: "native", "emulated",
    or the reason it cannot ("mxfp8 needs a GPU with compute capability >= 10.0 ...")."""
    info = declared_recipes(description).get(name)
    if info is None:
        return f"{description.name} does not offer {name}"
    problem = info.hardware_problem(hardware)
    if name in description.emulated_only:
        return "emulated"
    if not problem:
        return "native"
    return "emulated" if name in description.emulates else problem


def default_recipe(description: BackendDescription, precision: str) -> str | None:
    """The backend's first recipe for ``precision`` (its default there), or None."""
    return next((n for n, info in declared_recipes(description).items() if info.precision == precision), None)


def short_status(description: BackendDescription, name: str, hardware) -> str:
    """``recipe_status`` in a few words, for tables: "native", "emulated", "needs sm_100+"."""
    status = recipe_status(description, name, hardware)
    if status in ("native", "emulated"):
        return status
    info = declared_recipes(description)[name]
    need = f"needs sm_{info.min_capability[0]}{info.min_capability[1]}+"
    return need + (f" and CUDA {info.min_cuda[0]}.{info.min_cuda[1]}+" if info.min_cuda else "")


def recipe_rows(description: BackendDescription, hardware) -> list[dict[str, str]]:
    """A backend's recipes with their precision and how ``hardware`` runs each (``lowbit plugins``/``env``)."""
    return [
        {"recipe": name, "precision": info.precision, "here": short_status(description, name, hardware)}
        for name, info in declared_recipes(description).items()
    ]


def describe_recipes(rows: list[dict[str, str]]) -> str:
    """``fp8: tensorwise (emulated), mxfp8 (needs sm_100+); fp4: nvfp4 (emulated)``."""
    by_precision: dict[str, list[str]] = {}
    for row in rows:
        by_precision.setdefault(row["precision"], []).append(f"{row['recipe']} ({row['here']})")
    return "; ".join(f"{precision}: {', '.join(names)}" for precision, names in by_precision.items())
