"""Accelerate's ``accelerate.tracking``: an alias of :mod:`lowbit.compat.tracking`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.tracking")
