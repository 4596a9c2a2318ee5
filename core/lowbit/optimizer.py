"""Accelerate's ``accelerate.optimizer``: an alias of :mod:`lowbit.compat.optimizer`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.optimizer")
