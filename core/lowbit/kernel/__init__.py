"""lowbit's kernel: the plugin contract and the vocabulary every layer shares.

The hookspecs and the records hooks exchange (``types``), errors and notices, the plugin manager
and the registry that ranks what plugins describe, the recipe vocabulary, and
:mod:`lowbit.kernel.plugin_api`, the one module a plugin imports. The kernel imports nothing from
the runtime or the compatibility layer (``tests/test_layers.py``).
"""
