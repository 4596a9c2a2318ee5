"""Accelerate's ``accelerate.utils.constants``: an alias of :mod:`lowbit.compat.utils.constants`, which holds the
code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.constants")
