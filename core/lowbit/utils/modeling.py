"""Accelerate's ``accelerate.utils.modeling``: an alias of :mod:`lowbit.compat.utils.modeling`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.modeling")
