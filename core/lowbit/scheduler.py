"""Accelerate's ``accelerate.scheduler``: an alias of :mod:`lowbit.compat.scheduler`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.scheduler")
