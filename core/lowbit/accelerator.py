"""Accelerate's ``accelerate.accelerator``: an alias of :mod:`lowbit.compat.accelerator`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.accelerator")
