"""``lowbit env``: everything a bug report needs, ready to paste."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

from lowbit.kernel.version import installed_version


def add_parser(sub: Any, name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("--config_file", default=None, help="config to show (default: the default path)")
    parser.set_defaults(run=run)


def _version(dist: str) -> str:
    return installed_version(dist) or "not installed"


def _memory() -> str:
    """Total and available RAM, from the kernel (Linux) or the page counts."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo", encoding="ascii"))
        total, available = (int(fields[k].split()[0]) / 2**20 for k in ("MemTotal", "MemAvailable"))
        return f"{total:.1f} GiB, {available:.1f} GiB available"
    except (OSError, KeyError, ValueError):
        try:
            return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
        except (ValueError, OSError, AttributeError):
            return "unknown"


def _tested(version: str) -> str:
    from lowbit.kernel.version import TESTED_TORCH

    tested = ", ".join(TESTED_TORCH)
    same = version.split("+")[0] in TESTED_TORCH
    return f" ({'one of ' if same else 'not one of '}the versions lowbit's CI tests: {tested})"


def describe_cpu() -> str:
    """What decides CPU speed for low precision: the vector ISA torch uses and native bf16."""
    import torch

    from lowbit.kernel.cpu_features import cpu_has_native_bf16

    bf16 = (
        "native bf16 (AVX512-BF16 or AMX)"
        if cpu_has_native_bf16(when_unknown=False)
        else ("no native bf16: bf16 matmuls take a slow path")
    )
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}, {bf16}"


def run(args: argparse.Namespace) -> int:
    import yaml

    from lowbit.cli.plugins_command import collect

    from lowbit.kernel.recipe_names import describe_recipes

    from lowbit.runtime.training.toolchain import find_cxx_compiler

    from lowbit.run.settings import default_config_path, read_config_file

    report = collect()
    lines = [
        "- lowbit: " + _version("lowbit"),
        f"- Python: {sys.version.split()[0]} ({platform.platform()})",
        "- torch: " + _version("torch") + _tested(_version("torch")),
        "- pluggy: " + _version("pluggy"),
        "- numpy: " + _version("numpy"),
        "- RAM: " + _memory(),
        "- CPU: " + describe_cpu(),
        # the libraries the installed plugins drive, as each plugin names them
        *(
            f"- {dist}: {_version(dist)}"
            for dist in dict.fromkeys(lib for r in report["plugins"] for lib in r.get("libraries", []))
        ),
        f"- Hardware: {report['hardware']}",
        "- C++ compiler: "
        + (
            find_cxx_compiler()
            or "none found (torch.compile on CPU needs one; training without dynamo_backend does not)"
        ),
        f"- low-precision backend that would be chosen: {report['backend_choice'] or 'none'}",
        "- Plugins:",
        *(
            f"    {r['name']} ({r['distribution'] or '-'} {r['version']}) {r['role']} priority={r['priority']} "
            f"{r['status']}{': ' + r['reason'] if r['reason'] else ''}"
            for r in report["plugins"]
        ),
        "- Recipes per low-precision backend, and how this machine runs each:",
        *(
            f"    {r['name']}: {describe_recipes(r['recipes']) or 'one fixed recipe'}"
            for r in report["plugins"]
            if r.get("recipes") is not None
        ),
    ]
    path = args.config_file or default_config_path()
    lines.append(f"- Config file: {path}")
    try:
        data = read_config_file(path)
        lines.extend("    " + line for line in yaml.safe_dump(data, sort_keys=True).splitlines())
    except Exception as exc:  # noqa: BLE001 - a bug report must print even with a bad config
        lines.append(f"    ({exc})")
    print("\n".join(lines))
    return 0
