"""The recipe vocabulary: one name per format and scaling, mapped to whichever backend offers it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import pytest
from helpers import HardwareDetector, manager_with

from lowbit import Accelerator

from lowbit.kernel.errors import BackendUnavailableError, ConfigError
from lowbit.kernel.hookspecs import hookimpl
from lowbit.kernel.recipe_names import canonical_recipe, recipe_status
from lowbit.kernel.recipes import FP8RecipeKwargs, RecipeKwargs, recipe_name_option
from lowbit.kernel.types import BackendDescription, HardwareInfo, RecipeInfo

H100 = HardwareInfo("cpu", "stand-in H100", 1, (9, 0), (12, 9))
B200 = HardwareInfo("cpu", "stand-in B200", 1, (10, 0), (12, 9))
CPU = HardwareInfo("cpu", "CPU")


@dataclass
class GridRecipe(RecipeKwargs):
    backend_name: ClassVar[str] = "grid"
    recipe: str | None = recipe_name_option("tensorwise")


@dataclass
class TileRecipe(RecipeKwargs):
    backend_name: ClassVar[str] = "tile"
    recipe: str | None = recipe_name_option("delayed")


class Offering:
    """A backend that offers the given recipes (and emulates some): what the choice sees."""

    def __init__(self, name, priority, options_class, recipes, emulates=(), precisions=("fp8", "fp4")):
        self.description = BackendDescription(
            name, priority, True, options_class=options_class, recipes=recipes, emulates=emulates, precisions=precisions
        )

    @hookimpl
    def describe_backend(self, hardware):
        return self.description

    @hookimpl
    def autocast_context(self, model, context):
        return contextlib.nullcontext


def accelerator(hardware, *handlers, precision="fp8", **kwargs):
    grid = Offering(
        "grid", 100, GridRecipe, ("tensorwise", "mxfp8", "nvfp4"), emulates=("tensorwise", "mxfp8", "nvfp4")
    )
    tile = Offering("tile", 200, TileRecipe, ("delayed", "mxfp8", "nvfp4"))
    manager = manager_with(grid, tile, HardwareDetector(hardware))
    return Accelerator(mixed_precision=precision, kwargs_handlers=list(handlers), plugin_manager=manager, **kwargs)


def test_other_spellings_map_to_the_vocabulary_and_typos_get_a_suggestion():
    assert canonical_recipe("MXFP8BlockScaling") == "mxfp8"
    assert canonical_recipe("DelayedScaling") == "delayed"
    assert canonical_recipe("NVFP4") == "nvfp4"
    with pytest.raises(ConfigError, match=r"unknown recipe 'mxfp9'.*Did you mean 'mxfp8'"):
        canonical_recipe("mxfp9")
    with pytest.raises(ConfigError, match="unknown recipe 'rowise'"):
        FP8RecipeKwargs(recipe="rowise").to_recipe(GridRecipe)


def test_a_recipe_picks_the_backend_that_offers_it():
    assert accelerator(H100).fp8_backend == "tile"  # no recipe named: the ranking
    acc = accelerator(H100, FP8RecipeKwargs(recipe="tensorwise"))
    assert (acc.fp8_backend, acc.fp8_options.recipe, acc._run.context.recipe_runs) == ("grid", "tensorwise", "native")


def test_native_is_preferred_to_emulated_and_emulation_is_said():
    on_blackwell = accelerator(B200, FP8RecipeKwargs(recipe="mxfp8"))
    assert (on_blackwell.fp8_backend, on_blackwell._run.context.recipe_runs) == ("tile", "native")
    on_hopper = accelerator(H100, FP8RecipeKwargs(recipe="mxfp8"))  # tile cannot run it; grid emulates it
    assert (on_hopper.fp8_backend, on_hopper._run.context.recipe_runs) == ("grid", "emulated")


def test_a_named_backend_without_the_recipe_names_the_backends_that_have_it():
    with pytest.raises(
        BackendUnavailableError,
        match=r"recipe 'tensorwise' \(from TileRecipe\) is not offered by the "
        r"'tile' backend \(it offers: delayed, mxfp8, nvfp4\).*offering "
        r"'tensorwise': grid \(native\).*Backends not installed here, which may offer it.*ao",
    ):
        accelerator(H100, TileRecipe(recipe="tensorwise"))


def test_a_recipe_the_hardware_lacks_names_the_hardware_and_who_emulates_it():
    with pytest.raises(
        BackendUnavailableError,
        match=r"mxfp8 needs a GPU with compute capability >= 10.0 \(Blackwell\); "
        r"found stand-in H100 \(sm_90\) \(backend 'tile'\).*grid \(emulated\)",
    ):
        accelerator(H100, TileRecipe(recipe="mxfp8"))


def test_the_precision_follows_the_recipe():
    with pytest.raises(ConfigError, match=r"recipe 'nvfp4' .* trains in 'fp4'.*Set mixed_precision='fp4'"):
        accelerator(B200, FP8RecipeKwargs(recipe="nvfp4"))
    with pytest.raises(ConfigError, match=r"recipe 'mxfp8' .* trains in 'fp8'.*but mixed_precision is 'fp4'"):
        accelerator(B200, FP8RecipeKwargs(recipe="mxfp8"), precision="fp4")
    fp4 = accelerator(B200, precision="fp4")  # the backend's fp4 default, not its fp8 one
    assert (fp4.fp8_backend, fp4.fp8_options.recipe) == ("tile", "nvfp4")


def test_the_recipe_comes_from_the_config_file_the_env_and_the_old_name(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("mixed_precision: fp8\nfp8_config:\n  recipe: tensorwise\n")
    from_file = accelerator(H100, config_file=str(config))
    assert (from_file.fp8_backend, from_file.fp8_options.recipe) == ("grid", "tensorwise")
    monkeypatch.setenv("LOWBIT_FP8_RECIPE", "MXFP8BlockScaling")
    from_env = accelerator(B200)
    assert (from_env.fp8_backend, from_env.fp8_options.recipe) == ("tile", "mxfp8")
    monkeypatch.delenv("LOWBIT_FP8_RECIPE")
    old_name = accelerator(H100, FP8RecipeKwargs(scaling="tensorwise"))  # lowbit-te's name before the vocabulary
    assert old_name.fp8_options.recipe == "tensorwise"


INT8_ROWS = RecipeInfo("int8rows", "fp8", "int8 values, one scale per row", min_capability=(8, 0))


@dataclass
class RowsRecipe(RecipeKwargs):
    backend_name: ClassVar[str] = "rows"
    recipe: str | None = recipe_name_option("int8rows", own=(INT8_ROWS,))


def test_a_plugin_may_declare_a_recipe_of_its_own(monkeypatch):
    description = BackendDescription("x", 1, True, recipes=("tensorwise", INT8_ROWS))
    assert recipe_status(description, "int8rows", HardwareInfo("cpu", "A100", 1, (8, 0))) == "native"
    assert "needs a GPU with compute capability >= 8.0" in recipe_status(description, "int8rows", CPU)
    # Named through its own options class, the generic handler, or the env: the installed plugin's
    # declaration is what makes the name known (the config layer asks no plugin).
    assert RowsRecipe(recipe="INT8ROWS").recipe == "int8rows"
    rows = Offering("rows", 50, RowsRecipe, (INT8_ROWS,))
    manager = manager_with(rows, HardwareDetector(HardwareInfo("cpu", "A100", 1, (8, 0))))
    chosen = Accelerator(
        mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(recipe="int8rows")], plugin_manager=manager
    )
    assert (chosen.fp8_backend, chosen.fp8_options.recipe) == ("rows", "int8rows")
    monkeypatch.setenv("LOWBIT_FP8_RECIPE", "int8rows")
    assert Accelerator(mixed_precision="fp8", plugin_manager=manager).fp8_options.recipe == "int8rows"
    with pytest.raises(ConfigError, match=r"unknown recipe 'int8row'.*Did you mean 'int8rows'"):
        canonical_recipe("int8row", declared=(INT8_ROWS,))


def test_te_accepts_accelerates_mxfp8_switch():
    te_recipe = pytest.importorskip("lowbit_te.recipe")
    assert te_recipe.TERecipeKwargs(use_mxfp8_block_scaling=True).recipe == "mxfp8"
    with pytest.raises(ConfigError, match="contradict"):
        te_recipe.TERecipeKwargs(use_mxfp8_block_scaling=True, recipe="delayed")


def test_lowbit_plugins_lists_each_backends_recipes_and_how_they_run_here(capsys):
    pytest.importorskip("lowbit_ao")
    from lowbit.cli.main import main

    assert main(["plugins", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "ao         precisions: fp8, fp4; recipes here: fp8: tensorwise (emulated)" in out
    assert "fp4: nvfp4 (emulated)" in out
    assert main(["env"]) == 0
    assert "Recipes per low-precision backend" in capsys.readouterr().out


def test_lowbit_launch_takes_the_recipe_flag_in_any_spelling():
    pytest.importorskip("lowbit_ao")
    import sys as _sys

    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    saved, _sys.argv = _sys.argv, ["lowbit", "launch"]
    try:
        args = build_parser().parse_args(
            ["launch", "--mixed_precision", "fp8", "--fp8_recipe", "MXFP8BlockScaling", __file__]
        )
    finally:
        _sys.argv = saved
    _, env, _ = build_command(args)
    assert env["LOWBIT_FP8_RECIPE"] == "mxfp8"
