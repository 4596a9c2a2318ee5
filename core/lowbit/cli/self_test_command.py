"""``lowbit test``: check the configured environment end to end with a tiny seeded training.

It runs ``lowbit/cli/self_test.py`` exactly as ``lowbit launch`` would run a training script (same
config file, flags and launcher, so a multi-process config is tested multi-process).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from lowbit.cli.flags import add_config_flags
from lowbit.cli.launch import _add_plugin_flags, _plugin_manager, build_command, run_job


def add_parser(sub: Any, name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    manager = _plugin_manager()  # discovered once: the flags here, the environment in build_command
    add_config_flags(parser, manager)
    _add_plugin_flags(parser, manager)
    parser.set_defaults(run=run, plugin_manager=manager)


def run(args: argparse.Namespace) -> int:
    from lowbit.cli import self_test

    with tempfile.TemporaryDirectory(prefix="lowbit-test-") as work_dir:
        args.training_script = self_test.__file__
        args.training_script_args = [work_dir]
        command, extra_env, config = build_command(args)
        if config.debug:
            print(f"lowbit test: running: {' '.join(command)}", file=sys.stderr)
        return run_job(command, {**os.environ, **extra_env})
