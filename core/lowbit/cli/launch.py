"""``lowbit launch``: run a script on one process, or on many through torchrun.

Settings from the config file and the flags reach the script as ``LOWBIT_*`` env vars, which
the Accelerator reads. A multi-process run is a plain ``python -m torch.distributed.run``
launch; ``--debug`` prints the exact command.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowbit.cli.flags import add_config_flags, raw_config_from_args
from lowbit.distributions import install_command
from lowbit.errors import ConfigError
from lowbit.recipes import FP8_ENV_PREFIX

if TYPE_CHECKING:
    from lowbit.config import LowbitConfig


def add_parser(sub: Any, name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    add_config_flags(parser)
    _add_plugin_flags(parser)
    parser.add_argument("training_script", help="the script to run")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(run=run)


def _plugin_manager():
    from lowbit.plugins import make_plugin_manager

    return make_plugin_manager()


def _add_plugin_flags(parser: argparse.ArgumentParser) -> None:
    manager = _plugin_manager()
    manager.call_each("add_launch_arguments", parser=parser)
    for broken in manager.broken:
        print(f"lowbit launch: warning: plugin {broken.describe()}", file=sys.stderr)


SECTION_ENV_VARS = ("LOWBIT_DEEPSPEED_CONFIG", "LOWBIT_FSDP_CONFIG")


def _merge_section(from_config: str | None, from_flags: str) -> str:
    """Flags override the config file key by key within a JSON section, not the whole section."""
    merged = {**json.loads(from_config or "{}"), **json.loads(from_flags)}
    return json.dumps(merged)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            raise ConfigError(
                f"--main_process_port {port} is already in use on this machine. Pick another port, or leave it "
                "out on a single machine and lowbit picks a free one."
            ) from None


def build_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str], "LowbitConfig"]:
    """The command to run and the env vars to add, from the config file and the flags."""
    from lowbit.config import config_to_env, merge_raw, read_config_file, default_config_path, validate_config

    script = Path(args.training_script)
    if not script.is_file():
        raise ConfigError(f"Training script {str(script)!r} does not exist (looked in {os.getcwd()}).")
    path = Path(args.config_file) if args.config_file else default_config_path()
    file_raw = read_config_file(path) if (args.config_file or path.exists()) else {}
    flags_raw = raw_config_from_args(args)
    config = validate_config(merge_raw(file_raw, flags_raw), where=str(path), check_fp8_keys=False)
    if config.num_processes < 1 or config.num_machines < 1:
        raise ConfigError(f"--num_processes and --num_machines must be at least 1, got {config.num_processes} and {config.num_machines}.")
    if config.distributed_type == "NO" and config.num_processes * config.num_machines > 1:
        config.distributed_type = "MULTI_CPU" if config.use_cpu else "MULTI_GPU"

    env = config_to_env(config)
    env["LOWBIT_CONFIG_FILE"] = str(path) if file_raw else os.devnull
    manager = _plugin_manager()
    for _plugin, extra in manager.call_each("launch_environment", args=args):
        for key, value in extra.items():
            env[key] = _merge_section(env.get(key), str(value)) if key in SECTION_ENV_VARS else str(value)
    fp8_settings = sorted(k for k in env if k.startswith(FP8_ENV_PREFIX))
    if fp8_settings and config.mixed_precision != "fp8":
        raise ConfigError(
            f"FP8 options were given ({', '.join(fp8_settings)}, from the flags or the config's fp8_config) but "
            f"mixed_precision is {config.mixed_precision!r}, so they would do nothing. Add --mixed_precision fp8 "
            "(or mixed_precision: fp8 in the config), or drop the FP8 options."
        )
    if config.distributed_type == "DEEPSPEED" and "deepspeed" not in {manager.get_name(p) for p in manager.get_plugins()}:
        raise ConfigError(f"--use_deepspeed needs the DeepSpeed plugin, which is not installed: {install_command('deepspeed')}.")

    world = config.num_processes * config.num_machines
    if world == 1 and config.distributed_type in ("NO", "MULTI_CPU", "MULTI_GPU"):
        return [sys.executable, str(script), *args.training_script_args], env, config
    if config.num_machines > 1:
        if not config.main_process_ip:
            raise ConfigError("A multi-machine launch needs --main_process_ip (the address of machine 0).")
        port = config.main_process_port or 29500
        if config.machine_rank == 0:
            _check_port_free(port)
        rendezvous = ["--nnodes", str(config.num_machines), "--node_rank", str(config.machine_rank),
                      "--master_addr", config.main_process_ip, "--master_port", str(port)]
    else:
        port = config.main_process_port
        if port is None:
            port = _free_port()
        else:
            _check_port_free(port)
        rendezvous = ["--nnodes", "1", "--master_addr", config.main_process_ip or "127.0.0.1", "--master_port", str(port)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(config.num_processes),
               *rendezvous, str(script), *args.training_script_args]
    return command, env, config


def run(args: argparse.Namespace) -> int:
    command, extra_env, config = build_command(args)
    if config.debug:
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra_env.items()))
        print(f"lowbit launch: running: {shown} {shlex.join(command)}", file=sys.stderr, flush=True)
    completed = subprocess.run(command, env={**os.environ, **extra_env})
    return completed.returncode
