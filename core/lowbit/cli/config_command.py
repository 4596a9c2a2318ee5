"""``lowbit config``: write the YAML config, from flags, from questions, or with defaults."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lowbit.cli.flags import add_config_flags, raw_config_from_args

from lowbit.kernel.types import NATIVE_PRECISIONS


def add_parser(sub: Any, name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    add_config_flags(parser)
    parser.add_argument("--default", action="store_true", help="write the defaults, asking nothing")
    parser.set_defaults(run=run)


def _ask(question: str, default: str, choices: tuple[str, ...] | None = None) -> str:
    hint = f" [{'/'.join(choices)}]" if choices else ""
    while True:
        answer = input(f"{question}{hint} (default {default}): ").strip() or default
        if not choices:
            return answer
        match = next((c for c in choices if c.lower() == answer.lower()), None)  # "y", "multi_cpu": any case
        if match is not None:
            return match
        print(f"Please answer one of: {', '.join(choices)}.")


def _installed_choices() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The precisions and distributed types the installed plugins offer (they name them, not the core)."""
    from lowbit.kernel.registry import PluginRegistry
    from lowbit.kernel.types import NATIVE_PRECISIONS

    from lowbit.run.plugin_manager import make_plugin_manager
    from lowbit.run.settings import SINGLE_PROCESS_TYPES

    manager = make_plugin_manager()
    registry = PluginRegistry(manager, manager.detect_hardware(cpu=False))
    precisions = (*sorted(NATIVE_PRECISIONS), *registry.precision_names())
    return precisions, tuple(dict.fromkeys((*SINGLE_PROCESS_TYPES, *registry.distributed_type_names())))


def _interactive() -> dict[str, Any]:
    precisions, distributed_types = _installed_choices()
    raw: dict[str, Any] = {}
    raw["distributed_type"] = _ask("Distributed type?", "NO", distributed_types)
    if raw["distributed_type"] != "NO":
        raw["num_processes"] = int(_ask("Processes in all, across every machine?", "2"))
    raw["use_cpu"] = _ask("Train on CPU only?", "no", ("yes", "no")) == "yes"
    raw["mixed_precision"] = _ask("Mixed precision?", "no", precisions)
    if raw["mixed_precision"] not in NATIVE_PRECISIONS:
        backend = _ask(f"{raw['mixed_precision']} backend (empty: best available)?", "auto")
        if backend != "auto":
            raw["fp8_config"] = {"backend": backend}
    return raw


def run(args: argparse.Namespace) -> int:
    from lowbit.run.settings import default_config_path, validate_config, write_config_file

    raw = raw_config_from_args(args)
    if not raw and not args.default and sys.stdin.isatty():
        raw = _interactive()
    config = validate_config(raw, where="command line")
    path = write_config_file(config, args.config_file or default_config_path())
    print(f"lowbit config written to {path}")
    return 0
