"""Flags shared by ``lowbit config`` and ``lowbit launch``, and their mapping onto config keys."""
from __future__ import annotations

import argparse
from typing import Any

from lowbit.config import TOP_LEVEL
from lowbit.errors import ConfigError

# Flags that set distributed_type, as in Accelerate's launcher.
DISTRIBUTED_FLAGS = {"multi_gpu": "MULTI_GPU", "use_fsdp": "FSDP", "use_deepspeed": "DEEPSPEED"}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config_file", default=None, help="YAML config to read (default: lowbit's default path)")
    group = parser.add_argument_group("settings (override the config file)")
    for key, spec in TOP_LEVEL.items():
        if key == "use_cpu":
            continue
        if spec.type is bool:  # "--debug" alone means true; "--debug false" is accepted too
            group.add_argument(f"--{key}", nargs="?", const="true", default=None, metavar="BOOL", help=spec.help)
        else:
            group.add_argument(f"--{key}", type=spec.type, default=None, choices=spec.choices, help=spec.help)
    group.add_argument("--cpu", action="store_true", default=None, help="train on CPU (gloo between processes)")
    for flag, dtype in DISTRIBUTED_FLAGS.items():
        group.add_argument(f"--{flag}", action="store_true", default=None, help=f"distributed_type={dtype}")
    fp8 = parser.add_argument_group("fp8 (any backend)")
    fp8.add_argument("--fp8_backend", default=None, help="fp8 backend: msamp, te, ao, or a third-party name")
    fp8.add_argument("--fp8_opt_level", default=None, help="MS-AMP optimization level: O1 or O2 (letter O)")


def raw_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Only the settings given on the command line, shaped like the YAML file."""
    raw: dict[str, Any] = {}
    for key in TOP_LEVEL:
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    if getattr(args, "cpu", None):
        raw["use_cpu"] = True
    chosen = [flag for flag in DISTRIBUTED_FLAGS if getattr(args, flag, None)]
    if len(chosen) > 1:
        raise ConfigError(f"Choose one of --{' / --'.join(chosen)}: they are different distributed strategies.")
    if chosen:
        raw["distributed_type"] = DISTRIBUTED_FLAGS[chosen[0]]
    fp8 = {k: getattr(args, f"fp8_{k}", None) for k in ("backend", "opt_level")}
    fp8 = {k: v for k, v in fp8.items() if v is not None}
    if fp8:
        raw["fp8_config"] = fp8
    return raw
