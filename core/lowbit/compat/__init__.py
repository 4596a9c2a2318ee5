"""Accelerate's API on lowbit: its classes and functions under their names, its config files, its
fp8_backend and distributed-type names, its handler and plugin classes: Accelerate's names only
(transformers' and TRL's way in is ``lowbit.integrations.transformers``). The modules that must name
plugins to map Accelerate's names are listed, each with why, in tests/test_open_core.py.
"""
