"""What an import-light path of lowbit imports, seen from a fresh interpreter.

    python -m lowbit.conformance.import_probe discovery [--plugins NAMES] --heavy torch torchao ...
    python -m lowbit.conformance.import_probe cli --heavy torch ... -- plugins --json

``discovery`` loads the plugins (only ``--plugins``, a LOWBIT_PLUGINS value, when given) and
describes every backend for a CPU, as every lowbit start does; ``cli`` runs the ``lowbit`` command
with the arguments after ``--``. Either prints one JSON line last: the fp8 backends found
(discovery) and which of the ``--heavy`` top-level modules got imported. The conformance kit, the
tests and ``bench/startup.py`` launch this file rather than code of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lowbit.conformance.import_probe")
    parser.add_argument("path", choices=("discovery", "cli"))
    parser.add_argument("--plugins", default=None, help="LOWBIT_PLUGINS for the discovery")
    parser.add_argument("--heavy", nargs="*", default=[], help="top-level modules to report if imported")
    argv = sys.argv[1:] if argv is None else argv
    cli_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    result: dict[str, list[str]] = {}
    if args.path == "discovery":
        if args.plugins is not None:
            os.environ["LOWBIT_PLUGINS"] = args.plugins
        from lowbit.kernel.registry import PluginRegistry
        from lowbit.kernel.types import HardwareInfo

        from lowbit.run.plugin_manager import make_plugin_manager

        registry = PluginRegistry(make_plugin_manager(), HardwareInfo("cpu", "CPU"))
        result["backends"] = [c.name for c in registry.ranked("backend")]
    else:
        from lowbit.cli.main import main as lowbit_main

        try:
            lowbit_main(cli_args)
        except SystemExit:
            pass
    result["imported"] = sorted({m.split(".")[0] for m in sys.modules} & set(args.heavy))
    sys.stdout.write("\n" + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
