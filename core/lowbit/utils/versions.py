"""Accelerate's ``accelerate.utils.versions``: an alias of :mod:`lowbit.compat.utils.versions`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.versions")
