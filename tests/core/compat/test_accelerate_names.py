"""Every name docs/coming-from-accelerate.md lists as 'same' exists under lowbit."""

from __future__ import annotations

import importlib
import re

import pytest
from helpers import ROOT

DOC = (ROOT / "docs" / "coming-from-accelerate.md").read_text()


def same_rows():
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[1] == "same":
            yield cells[0]


def listed_names():
    names = []
    for row in same_rows():
        module = "lowbit.utils" if row.startswith("`lowbit.utils`") else None
        for name in re.findall(r"`([A-Za-z_][\w.]*)(?:\(|`)", row):
            if name in ("lowbit.utils",):
                continue
            names.append((module, name))
    return names


@pytest.fixture(scope="module")
def accelerator():
    from helpers import manager_with

    from lowbit import Accelerator

    return Accelerator(plugin_manager=manager_with())


@pytest.mark.parametrize("module, name", listed_names())
def test_listed_name_exists(module, name, accelerator):
    from lowbit import Accelerator

    if module is not None:
        assert hasattr(importlib.import_module(module), name), f"lowbit.utils.{name}"
    elif name.startswith("lowbit."):
        path, attr = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(path), attr), name
    elif name.startswith("accelerator."):
        attr = name.split(".", 1)[
            1
        ]  # on the class first: a property may refuse on this Accelerator (a mesh rank without a mesh)
        assert hasattr(Accelerator, attr) or hasattr(accelerator, attr), name
    elif name == "Accelerator":
        assert Accelerator
    else:
        assert hasattr(accelerator, name), f"Accelerator.{name}"


def test_the_table_lists_names():
    assert len(listed_names()) > 60
