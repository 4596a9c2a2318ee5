"""Accelerate's ``accelerate.parallelism_config``: an alias of :mod:`lowbit.run.layout`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.run.layout")
