"""Accelerate's ``accelerate.big_modeling``: an alias of :mod:`lowbit.compat.big_modeling`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.big_modeling")
