"""lowbit's runtime: what ``prepare()`` builds and what runs after it. ``run/`` decides once, before
``prepare()``; ``runtime/`` runs from ``prepare()`` on.

Preparation and the prepared objects (``training``), the built-in strategies (``builtin``),
checkpoints, observation, and the process group's facts and collectives. It imports the kernel
and itself, never the compatibility layer above it (``tests/test_layers.py``).
"""
