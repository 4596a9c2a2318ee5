"""Accelerate's ``accelerate.utils.other``: an alias of :mod:`lowbit.compat.utils.other`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.other")
