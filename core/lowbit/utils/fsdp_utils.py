"""Accelerate's ``accelerate.utils.fsdp_utils``: an alias of :mod:`lowbit.compat.utils.fsdp_utils`, which holds the
code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.fsdp_utils")
