"""Accelerate's ``accelerate.utils.dataclasses``: an alias of :mod:`lowbit.compat.utils.dataclasses`, which holds
the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.dataclasses")
