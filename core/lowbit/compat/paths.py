"""Accelerate's module paths (``lowbit.state`` for ``accelerate.state``, ...) as aliases of the
compatibility modules that hold the code, so the package's folders show lowbit's own layers.

A path's shell file calls :func:`alias_module`: importing ``lowbit.state`` gives the very module
object ``lowbit.compat.state`` (one copy of each class, patches seen by both names), loaded only
when a script imports that path.
"""

from __future__ import annotations

import importlib
import sys


def public_path(module: str) -> str:
    """The path a script imports a compatibility module by: ``lowbit.compat.utils.environment`` ->
    ``lowbit.utils.environment`` (its loggers and messages use it, as Accelerate's use its own)."""
    return module.replace("lowbit.compat.", "lowbit.", 1)


def alias_module(path: str, target: str) -> None:
    """Make ``path`` name the module ``target`` (imported now) in ``sys.modules``."""
    sys.modules[path] = importlib.import_module(target)
