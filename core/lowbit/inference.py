"""Accelerate's ``accelerate.inference``: an alias of :mod:`lowbit.compat.inference`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.inference")
