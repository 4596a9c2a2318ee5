"""Accelerate's ``accelerate.parallelism_config``: an alias of :mod:`lowbit.compat.parallelism_config`, which holds the code."""
from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.parallelism_config")
