"""Accelerate's ``accelerate.hooks``: an alias of :mod:`lowbit.compat.hooks`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.hooks")
