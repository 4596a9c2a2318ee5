"""Accelerate's ``accelerate.logging``: an alias of :mod:`lowbit.compat.logging`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.logging")
