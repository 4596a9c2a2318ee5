"""Accelerate's ``accelerate.utils.random``: an alias of :mod:`lowbit.compat.utils.random`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.random")
