"""Imports torchao as a user would (``import torchao``) or, with ``--quiet``, through lowbit-ao's
quiet import (test_ao.py compares what each prints to stderr)."""

import sys

if "--quiet" in sys.argv:
    from lowbit_ao.quiet_import import import_torchao

    import_torchao()
else:
    import torchao  # noqa: F401
