"""Accelerate's ``accelerate.data_loader``: an alias of :mod:`lowbit.compat.data_loader`, which holds the code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.data_loader")
