"""The snippets of Accelerate's low-precision docs, with `accelerate` replaced by `lowbit`."""

from __future__ import annotations

import pytest

from lowbit import Accelerator

from lowbit.kernel.errors import BackendUnavailableError


def test_plain_fp8_accelerator_picks_the_best_backend():
    pytest.importorskip("lowbit_ao")
    accelerator = Accelerator(mixed_precision="fp8")
    assert accelerator.fp8_backend == "ao"  # the only usable one on this CPU


def test_fp8_recipe_kwargs_with_the_docs_misspelled_handler_argument():
    from lowbit.utils import FP8RecipeKwargs

    kwargs = [FP8RecipeKwargs(backend="msamp", optimization_level="O2")]
    with pytest.raises(
        BackendUnavailableError, match=r"msamp.*(not installed|cannot run here).*Detected hardware: CPU"
    ):
        Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)
    kwargs = [FP8RecipeKwargs(backend="te")]
    with pytest.raises(BackendUnavailableError, match=r"'te'.*Detected hardware: CPU"):
        Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)


def test_recipe_classes_import_from_lowbit_utils():
    pytest.importorskip("lowbit_ao")
    from lowbit.utils import AORecipeKwargs

    kwargs = [AORecipeKwargs()]
    accelerator = Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)
    assert accelerator.fp8_backend == "ao"


def test_a_recipe_class_whose_plugin_is_absent_names_the_pip_package(monkeypatch):
    import lowbit.utils.dataclasses

    monkeypatch.setitem(lowbit.utils.dataclasses.PLUGIN_CLASSES, "TERecipeKwargs", ("lowbit_te_not_here.recipe", "te"))
    from lowbit.utils import TERecipeKwargs  # imports, as in Accelerate: a script may name it and train on ao

    with pytest.raises(
        ImportError,
        match=r"TERecipeKwargs comes with the te backend's plugin, which is not installed: `pip install lowbit-te`",
    ):
        TERecipeKwargs()
