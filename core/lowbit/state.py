"""Accelerate's ``accelerate.state``: an alias of :mod:`lowbit.compat.state`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.state")
