"""Print, as JSON, which lowbit modules one import loads in a fresh process, and whether it loads
torch: the figures the layers are held to (tests/test_layers.py, docs/architecture.md).

    python tests/scripts/modules_loaded.py root|set_seed|accelerator|plugin_manager
"""

from __future__ import annotations

import json
import sys
import warnings


def load(which: str) -> None:
    if which == "root":
        import lowbit  # noqa: F401
    elif which == "set_seed":
        from lowbit.utils import set_seed  # noqa: F401
    elif which == "accelerator":
        from lowbit import Accelerator  # noqa: F401
    elif which == "plugin_manager":
        from lowbit.run.plugin_manager import make_plugin_manager

        make_plugin_manager()  # the built-ins and every installed entry point
    else:
        raise SystemExit(f"unknown import {which!r}: root, set_seed, accelerator or plugin_manager")


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    load(sys.argv[1])
    print(
        json.dumps(
            {
                "lowbit": sorted(m for m in sys.modules if m == "lowbit" or m.startswith("lowbit.")),
                "torch": "torch" in sys.modules,
            }
        )
    )
