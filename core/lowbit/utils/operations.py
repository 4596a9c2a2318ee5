"""Accelerate's ``accelerate.utils.operations``: an alias of :mod:`lowbit.compat.utils.operations`, which holds the
code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.operations")
