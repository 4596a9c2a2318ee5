"""Accelerate's ``accelerate.utils.environment``: an alias of :mod:`lowbit.compat.utils.environment`, which holds
the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.environment")
