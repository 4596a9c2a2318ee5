"""Accelerate's ``accelerate.local_sgd``: an alias of :mod:`lowbit.compat.local_sgd`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.local_sgd")
