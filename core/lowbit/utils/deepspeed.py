"""Accelerate's ``accelerate.utils.deepspeed``: an alias of :mod:`lowbit.compat.utils.deepspeed`, which holds the
code."""

from lowbit.compat.paths import alias_module

alias_module(__name__, "lowbit.compat.utils.deepspeed")
