"""Accelerate's ``accelerate.utils.memory``: an alias of :mod:`lowbit.compat.utils.memory`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.memory")
