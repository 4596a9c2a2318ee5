"""Accelerate's ``accelerate.launchers``: an alias of :mod:`lowbit.compat.launchers`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.launchers")
