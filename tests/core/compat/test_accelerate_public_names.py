"""Every top-level name of Accelerate (the installed one, 1.15 here) exists in lowbit: the same
thing, or a name that refuses clearly, saying what to use. docs/coming-from-accelerate.md lists
each with its status; this test writes the list it expects when they differ."""
from __future__ import annotations

import re

import pytest

import lowbit
from lowbit.big_modeling import INFERENCE_DISPATCH
from lowbit.errors import UnsupportedCombinationError
from helpers import ROOT

accelerate = pytest.importorskip("accelerate")
NAMES = sorted(name for name in dir(accelerate) if not name.startswith("_"))
DOC = ROOT / "docs" / "coming-from-accelerate.md"
TABLE_START = "<!-- accelerate top-level names: written by tests/core/compat/test_accelerate_public_names.py -->"


def status(name: str) -> str:
    try:
        getattr(lowbit, name)
    except UnsupportedCombinationError:
        return "refused on import (says what to use)"
    if name in INFERENCE_DISPATCH:
        return "refused when called (big-model inference dispatch; says what to use)"
    return "same"


@pytest.mark.parametrize("name", NAMES)
def test_each_top_level_name_of_accelerate_is_in_lowbit_or_refused_clearly(name):
    try:
        value = getattr(lowbit, name)
    except UnsupportedCombinationError as exc:
        assert "lowbit" in str(exc) and ("use" in str(exc) or "call" in str(exc)), str(exc)
        return
    if name in INFERENCE_DISPATCH:
        with pytest.raises(UnsupportedCombinationError, match=rf"{name} spreads a model .* Use Accelerate's"):
            value(None)


def test_init_empty_weights_builds_a_model_in_no_memory():
    import torch

    with lowbit.init_empty_weights():
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024))
    assert all(p.is_meta for p in model.parameters()) and not model[1].running_mean.is_meta
    assert isinstance(model[0].weight, torch.nn.Parameter) and model[0].weight.requires_grad
    with lowbit.init_on_device("meta", include_buffers=True):
        assert torch.nn.BatchNorm1d(4).running_mean.is_meta
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block


def test_the_docs_list_every_name_with_its_status():
    expected = "\n".join([TABLE_START, "", "| name | in lowbit |", "|---|---|",
                          *(f"| `{name}` | {status(name)} |" for name in NAMES)])
    text = DOC.read_text()
    found = re.search(re.escape(TABLE_START) + r"\n\n(?:\|.*\n)+", text)
    assert found is not None and found.group(0).rstrip("\n") == expected, f"write this into {DOC.name}:\n{expected}"


def test_accelerates_utils_submodule_paths_import_under_lowbit():
    """The ``accelerate.utils.<submodule>`` imports of Accelerate's own tests, rewritten to lowbit."""
    from lowbit.utils.dataclasses import AORecipeKwargs, DataLoaderConfiguration, DistributedType  # noqa: F401
    from lowbit.utils.imports import is_deepspeed_available, is_transformers_available
    from lowbit.utils.memory import clear_device_cache, find_executable_batch_size, release_memory  # noqa: F401
    from lowbit.utils.operations import gather, recursively_apply  # noqa: F401
    from lowbit.utils.other import extract_model_from_parallel  # noqa: F401
    from lowbit.utils.random import set_seed
    from lowbit.utils.versions import compare_versions, is_torch_version

    import random

    set_seed(7)
    first = random.random()
    set_seed(7)
    assert random.random() == first  # lowbit.utils.random (the submodule) does not shadow Python's random
    assert is_torch_version(">=", "2.0") and not compare_versions("torch", "<", "2.0")
    assert isinstance(is_transformers_available(), bool) and isinstance(is_deepspeed_available(), bool)
