"""Accelerate's ``accelerate.utils.imports``: an alias of :mod:`lowbit.compat.utils.imports`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.imports")
