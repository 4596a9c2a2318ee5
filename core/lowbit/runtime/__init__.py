"""lowbit's runtime: the parts a run is made of, each handed only what it needs and none knowing
its owner (``run/`` holds the run: it decides once, wires these parts and drives the loop's verbs).

Preparation and the prepared objects (``training``), the built-in strategies (``builtin``),
checkpoints, observation, and the process group's facts and collectives. It imports the kernel
and itself, never the compatibility layer above it (``tests/test_layers.py``).
"""
