"""Flags shared by ``lowbit config`` and ``lowbit launch``, and their mapping onto config keys."""

from __future__ import annotations

import argparse
from typing import Any

from lowbit.kernel.errors import ConfigError

from lowbit.run.accelerate_config import (
    FSDP_IGNORED,
    FSDP_MUST_BE_OFF,
    PARALLELISM_PREFIX,
    note_ignored,
    translate_fsdp,
)
from lowbit.run.settings import TOP_LEVEL

# Flags that set distributed_type, as in Accelerate's launcher.
DISTRIBUTED_FLAGS = {"multi_gpu": "MULTI_GPU", "use_fsdp": "FSDP", "use_deepspeed": "DEEPSPEED"}
# Accelerate's FSDP launcher flags (its fsdp_config key names); lowbit's FSDP2 strategy reads
# the first three, the others are explained when given (see accelerate_config.py).
FSDP_FLAGS = (
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_reshard_after_forward",
    "fsdp_sharding_strategy",
    "fsdp_auto_wrap_policy",
    "fsdp_activation_checkpointing",
    "fsdp_sync_module_states",
    "fsdp_cpu_ram_efficient_loading",
    *FSDP_MUST_BE_OFF,
    *FSDP_IGNORED,
)


def add_config_flags(parser: argparse.ArgumentParser, manager: Any = None) -> None:
    """The settings' flags, and the launch switches of the strategies ``manager`` found (None: discover them)."""
    parser.add_argument("--config_file", default=None, help="YAML config to read (default: lowbit's default path)")
    group = parser.add_argument_group("settings (override the config file)")
    for key, spec in TOP_LEVEL.items():
        if key == "use_cpu":
            continue
        if spec.type is bool:  # "--debug" as in Accelerate; "--no-debug" turns off what a config file turned on
            group.add_argument(f"--{key}", action=argparse.BooleanOptionalAction, default=None, help=spec.help)
        else:
            group.add_argument(f"--{key}", type=spec.type, default=None, choices=spec.choices, help=spec.help)
    group.add_argument("--cpu", action="store_true", default=None, help="train on CPU (gloo between processes)")
    for flag, dtype in DISTRIBUTED_FLAGS.items():
        group.add_argument(f"--{flag}", action="store_true", default=None, help=f"distributed_type={dtype}")
    switches = _strategy_switches(manager)
    for flag, name in switches.items():
        group.add_argument(
            f"--{flag}", action="store_true", default=None, help=f"distributed_type={name} (a plugin's strategy)"
        )
    parser.set_defaults(lowbit_strategy_switches=switches)
    fsdp = parser.add_argument_group("FSDP, with --use_fsdp (Accelerate's flag names)")
    for flag in FSDP_FLAGS:
        fsdp.add_argument(
            f"--{flag}", default=None, metavar="VALUE", help=argparse.SUPPRESS if flag in FSDP_IGNORED else None
        )
    layout = parser.add_argument_group("parallel layout (Accelerate's ParallelismConfig)")
    for key in PARALLELISM_FLAGS:
        layout.add_argument(f"--{PARALLELISM_PREFIX}{key}", default=None, metavar="VALUE")
    fp8 = parser.add_argument_group("fp8 (any backend)")
    fp8.add_argument(
        "--fp8_backend", default=None, help="the low-precision backend to use (`lowbit plugins` lists them)"
    )
    fp8.add_argument("--fp8_opt_level", default=None, help="MS-AMP optimization level: O1 or O2 (letter O)")


# Accelerate's --parallelism_config_* flags, without the prefix (the keys of the parallelism_config section).
PARALLELISM_FLAGS = (
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "cp_backend",
    "cp_comm_strategy",
    "sp_size",
    "sp_backend",
)


def _strategy_switches(manager: Any = None) -> dict[str, str]:
    """The launch switches installed strategies declare, beyond Accelerate's own."""
    from lowbit.run.plugin_manager import registry_for_names

    switches = registry_for_names(manager).launch_switches()
    return {flag: name for flag, name in switches.items() if flag not in DISTRIBUTED_FLAGS}


def raw_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Only the settings given on the command line, shaped like the YAML file."""
    raw: dict[str, Any] = {}
    for key in TOP_LEVEL:
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    if getattr(args, "cpu", None):
        raw["use_cpu"] = True
    switches = {**DISTRIBUTED_FLAGS, **getattr(args, "lowbit_strategy_switches", {})}
    chosen = [flag for flag in switches if getattr(args, flag, None)]
    if len(chosen) > 1:
        raise ConfigError(f"Choose one of --{' / --'.join(chosen)}: they are different distributed strategies.")
    if chosen:
        raw["distributed_type"] = switches[chosen[0]]
    fsdp = {flag: getattr(args, flag) for flag in FSDP_FLAGS if getattr(args, flag, None) is not None}
    if fsdp:
        ignored: list[str] = []
        raw["fsdp_config"] = translate_fsdp(fsdp, "the --fsdp_* flags", ignored)
        note_ignored("the --fsdp_* flags", ignored)
    layout = {
        key: getattr(args, PARALLELISM_PREFIX + key)
        for key in PARALLELISM_FLAGS
        if getattr(args, PARALLELISM_PREFIX + key, None) is not None
    }
    if layout:
        raw["parallelism_config"] = layout
    fp8 = {k: getattr(args, f"fp8_{k}", None) for k in ("backend", "opt_level")}
    fp8 = {k: v for k, v in fp8.items() if v is not None}
    if fp8:
        raw["fp8_config"] = fp8
    return raw
