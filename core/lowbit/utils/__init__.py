"""Accelerate's ``accelerate.utils``: its names come from :mod:`lowbit.compat.utils`, loaded on
first use (``from lowbit.utils import set_seed`` loads the seeding module, not the rest).

The package stays a folder so that Accelerate's submodule paths (``lowbit.utils.operations``,
...) import too; each is an alias of its ``lowbit.compat.utils`` module.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    gathered = importlib.import_module("lowbit.compat.utils")
    value = getattr(gathered, name)
    if name in vars(gathered):  # a name that stays put once found: kept here too
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return dir(importlib.import_module("lowbit.compat.utils"))
