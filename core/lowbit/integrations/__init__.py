"""Other libraries' ways in to lowbit, a room each, named for the library: what changes when that
library changes lives here, not with Accelerate's names (``compat/``). The top layer: it may import
every layer below (``tests/test_layers.py``)."""
