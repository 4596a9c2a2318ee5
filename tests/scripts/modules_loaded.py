"""Print, as JSON, which lowbit modules one import loads in a fresh process, and whether it loads
torch: the figures the layers are held to (tests/test_layers.py, docs/architecture.md).

    python tests/scripts/modules_loaded.py root|set_seed|accelerator|plugin_manager
    python tests/scripts/modules_loaded.py launch_command SCRIPT   (what `lowbit launch` loads to build its command)
"""

from __future__ import annotations

import json
import sys
import warnings


def load(which: str, script: str = "") -> None:
    if which == "root":
        import lowbit  # noqa: F401
    elif which == "set_seed":
        from lowbit.utils import set_seed  # noqa: F401
    elif which == "accelerator":
        from lowbit import Accelerator  # noqa: F401
    elif which == "plugin_manager":
        from lowbit.run.plugin_manager import make_plugin_manager

        make_plugin_manager()  # the built-ins and every installed entry point
    elif which == "launch_command":
        from lowbit.cli.launch import build_command
        from lowbit.cli.main import build_parser

        sys.argv = ["lowbit", "launch"]  # the launcher builds only the chosen subcommand's parser
        build_command(build_parser().parse_args(["launch", "--cpu", "--num_processes", "2", script]))
    else:
        raise SystemExit(f"unknown import {which!r}: root, set_seed, accelerator, plugin_manager or launch_command")


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    load(*sys.argv[1:3])
    print(
        json.dumps(
            {
                "lowbit": sorted(m for m in sys.modules if m == "lowbit" or m.startswith("lowbit.")),
                "torch": "torch" in sys.modules,
            }
        )
    )
