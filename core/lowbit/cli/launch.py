"""``lowbit launch``: run a script on one process, or on many through torchrun.

The run's settings from the config file and the flags reach the script as ``LOWBIT_*`` env vars,
which the Accelerator reads; the launcher's own (processes, machines, where they meet, GPU ids,
debug: ``LauncherSettings``) stay here, as torchrun tells each rank its place. A multi-process run
is a plain ``python -m torch.distributed.run`` launch; ``--debug`` prints the exact command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowbit.cli.cluster import check_one_job, only_this_machine_note, read_cluster_job
from lowbit.cli.flags import add_config_flags, raw_config_from_args
from lowbit.cli.launcher_flags import (
    TORCHRUN_FLAGS,
    accept_hyphenated_spellings,
    add_launcher_flags,
    check_multinode_launcher,
    check_torchrun_values,
    flags_without_effect,
    flags_without_torchrun,
)
from lowbit.cli.run_script import patching_wanted

from lowbit.kernel import notices
from lowbit.kernel.env_numbers import SIMULATE_NCCL_ENV as SIMULATE_ENV
from lowbit.kernel.errors import ConfigError
from lowbit.kernel.first_party import first_party, install_command
from lowbit.kernel.recipes import FP8_ENV_PREFIX
from lowbit.kernel.types import NATIVE_PRECISIONS

from lowbit.run.accelerate_config import loading_once_per_machine_env, note_ignored
from lowbit.run.settings import SINGLE_PROCESS_TYPES

if TYPE_CHECKING:
    from lowbit.cli.cluster import ClusterJob

    from lowbit.run.settings import LauncherSettings, LowbitConfig


RUNNER = "lowbit.cli.run_script"


def add_parser(sub: Any, name: str, help_text: str) -> None:
    # No abbreviations: a script argument after the script (--fsdp) must not be read as a prefix of a launcher flag.
    parser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
    # The plugins are discovered once per launch: their flags here, their environment in build_command.
    manager = _plugin_manager()
    add_config_flags(parser, manager)
    _add_plugin_flags(parser, manager)
    parser.set_defaults(plugin_manager=manager)
    _add_launcher_flags(parser)
    parser.add_argument("training_script", help="the script to run (a module name with -m)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    accept_hyphenated_spellings(parser)
    parser.set_defaults(run=run)


def _add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launcher (as in accelerate launch)")
    group.add_argument(
        "-m", "--module", action="store_true", help="run the script argument as a module, like python -m"
    )
    group.add_argument("--num_cpu_threads_per_process", type=int, default=None, help="OMP_NUM_THREADS for each process")
    group.add_argument(
        "--simulate_nccl",
        action="store_true",
        help="on CPU processes, refuse what NCCL refuses: a lowbit collective on a tensor not put on the "
        "group's device fails as it would on GPUs (sets LOWBIT_SIMULATE_NCCL=1)",
    )
    add_launcher_flags(group, parser)


def _plugin_manager():
    from lowbit.run.plugin_manager import make_plugin_manager

    return make_plugin_manager()


def _add_plugin_flags(parser: argparse.ArgumentParser, manager: Any) -> None:
    manager.call_each("add_launch_arguments", parser=parser)
    for broken in manager.broken:
        print(f"lowbit launch: warning: plugin {broken.describe()}", file=sys.stderr)


def _is_section_env_var(key: str) -> bool:
    """``LOWBIT_<SECTION>_CONFIG``: a strategy's section as JSON (plugins' launch flags fill them)."""
    return key.startswith("LOWBIT_") and key.endswith("_CONFIG") and not key.startswith(FP8_ENV_PREFIX)


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


# How long the c10d endpoint's port is probed for a rendezvous store when something holds it.
C10D_PROBE_SECONDS = 5


def _check_c10d_endpoint(host: str, port: int) -> None:
    """On the machine that hosts a c10d rendezvous (its address is this machine's): the port is
    free, or held by the rendezvous store of this job (another launcher here came first). Held by
    anything else, torchrun would wait on it for minutes: an error now. Elsewhere: nothing to check."""
    import errno

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
            return  # free: this launcher's torchrun hosts the store
        except socket.gaierror:
            return  # a name this machine cannot resolve: torchrun says so itself
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # not an address of this machine: another machine hosts the store
    probe = [sys.executable, "-m", "lowbit.cli.rendezvous_probe", host, str(port), str(C10D_PROBE_SECONDS)]
    try:
        answered = subprocess.run(probe, capture_output=True, timeout=C10D_PROBE_SECONDS + 15).returncode == 0
    except subprocess.TimeoutExpired:
        answered = False
    if not answered:  # whatever holds the port, it is no rendezvous store
        raise ConfigError(
            f"--main_process_port {port} on {host} (the c10d rendezvous endpoint, this machine) is held by another "
            f"program, not a rendezvous store: torchrun would wait on it for minutes. Pick a free port for "
            "--main_process_port on every machine."
        )


def build_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str], "LowbitConfig"]:
    """The command to run and the env vars to add, from the config file and the flags."""
    from lowbit.run.plugin_manager import registry_for_names
    from lowbit.run.settings import (
        LauncherSettings,
        check_plugin_names,
        config_from_env,
        default_config_path,
        merge_raw,
        read_config_file,
        run_settings_env,
        validate_config,
    )

    # `lowbit test` builds its command here too, without the launcher-only flags.
    module = getattr(args, "module", False)
    threads = getattr(args, "num_cpu_threads_per_process", None)
    script = Path(args.training_script)
    # A file, or a folder with a __main__.py (as ``python DIR`` runs it)
    if not module and not script.is_file() and not (script / "__main__.py").is_file():
        if script.is_dir():
            raise ConfigError(
                f"Training script {str(script)!r} is a folder without a __main__.py: python runs a folder by its "
                "__main__.py. Name the script inside it, or add -m to run a package."
            )
        raise ConfigError(
            f"Training script {str(script)!r} does not exist (looked in {os.getcwd()}). To run a module, add -m."
        )
    note_ignored("lowbit launch", flags_without_effect(args))
    if module and getattr(args, "no_python", False):
        raise ConfigError("-m runs a Python module and --no_python runs a program that is not Python: give one.")
    if getattr(args, "no_python", False) and not os.access(script, os.X_OK):
        raise ConfigError(
            f"--no_python runs {str(script)!r} as a program, and it is not executable: `chmod +x {script}` (with a "
            "#! line naming its interpreter), or leave out --no_python to run it with python."
        )
    check_torchrun_values(args)
    path = Path(args.config_file) if args.config_file else default_config_path()
    file_raw = read_config_file(path) if (args.config_file or path.exists()) else {}
    flags_raw = raw_config_from_args(args)
    # LOWBIT_* variables set where lowbit launch runs count as in the script: over the file, under the flags
    env_raw = config_from_env(os.environ)
    # What a scheduler says about the job (Slurm, torchrun's PET_* variables) lies below them all.
    cluster = read_cluster_job(os.environ)
    cluster_raw = cluster.settings if cluster else {}
    config = validate_config(
        merge_raw(cluster_raw, file_raw, env_raw, flags_raw), where=str(path), check_fp8_keys=False
    )
    _one_job_of_the_cluster(cluster, config, _given_by("num_machines", flags_raw, env_raw, file_raw, path))
    gpu_ids = _gpu_ids(config.gpu_ids)
    machine_gpus = _visible_gpu_count() if not config.use_cpu else 0
    if gpu_ids and not machine_gpus:
        print(
            f"lowbit launch: note: --gpu_ids {config.gpu_ids} names GPUs, but "
            f"{'--cpu was given' if config.use_cpu else 'this machine shows none'}: "
            "the flag does nothing here (--num_processes sets how many CPU processes).",
            file=sys.stderr,
            flush=True,
        )
        gpu_ids = []
    if not any("num_processes" in raw for raw in (file_raw, env_raw, flags_raw)):
        per_machine = cluster.processes_per_machine if cluster else None
        visible = len(gpu_ids) if gpu_ids else machine_gpus
        if per_machine is None and not config.use_cpu and visible > 1:
            per_machine = visible  # as accelerate launch: one process per visible GPU, on each machine
            print(
                f"lowbit launch: {visible} GPUs visible: {visible * config.num_machines} processes, one per GPU "
                "(--num_processes to choose).",
                file=sys.stderr,
                flush=True,
            )
        if per_machine is None and config.num_machines > 1:
            per_machine = 1
        if per_machine:
            config = dataclasses.replace(config, num_processes=per_machine * config.num_machines)
    if config.num_processes < 1 or config.num_machines < 1:
        raise ConfigError(
            f"--num_processes and --num_machines must be at least 1, got {config.num_processes} and "
            f"{config.num_machines}."
        )
    if config.num_processes % config.num_machines:
        raise ConfigError(
            f"--num_processes is the total across machines (as in Accelerate): {config.num_processes} processes "
            "cannot be "
            f"split evenly over {config.num_machines} machines. Give a multiple of {config.num_machines}."
        )
    if gpu_ids and config.num_processes // config.num_machines > len(gpu_ids):
        raise ConfigError(
            f"--gpu_ids {config.gpu_ids} gives {len(gpu_ids)} GPU(s) to {config.num_processes // config.num_machines} "
            "processes "
            "per machine: each process needs a GPU of its own (two ranks on one GPU fail in NCCL). Give as many ids as "
            "processes, or lower --num_processes."
        )
    if config.distributed_type == "NO" and config.num_processes > 1:
        config = dataclasses.replace(config, distributed_type="MULTI_CPU" if config.use_cpu else "MULTI_GPU")

    launcher = LauncherSettings.of(config)  # settled: what follows reads the launcher's own record
    env = run_settings_env(config)  # the ranks get the run's settings only
    env.update(loading_once_per_machine_env(config.distributed_type, config.fsdp_config))
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    env["LOWBIT_CONFIG_FILE"] = str(path) if file_raw else os.devnull
    env.update(file_sources(file_raw, merge_raw(env_raw, flags_raw), path))
    manager = getattr(args, "plugin_manager", None) or _plugin_manager()  # a caller's own arguments: discover
    for _plugin, extra in manager.call_each("launch_environment", args=args):
        for key, value in extra.items():
            env[key] = _merge_section(env.get(key), str(value)) if _is_section_env_var(key) else str(value)
    registry = registry_for_names(manager)
    _check_strategy_installed(config, registry)
    check_plugin_names(config, registry.precision_names(), registry.distributed_type_names(), where=str(path))
    fp8_settings = sorted(k for k in env if k.startswith(FP8_ENV_PREFIX))
    if fp8_settings and config.mixed_precision in NATIVE_PRECISIONS:
        raise ConfigError(
            f"FP8 options were given ({', '.join(fp8_settings)}, from the flags or the config's fp8_config) but "
            f"mixed_precision is {config.mixed_precision!r}, so they would do nothing. Add --mixed_precision fp8 "
            "(or mixed_precision: fp8 in the config), or drop the FP8 options."
        )

    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if getattr(args, "simulate_nccl", False):
        env[SIMULATE_ENV] = "1"
    target = ["-m", args.training_script] if module else [str(script)]
    no_python = getattr(args, "no_python", False)
    # Through lowbit's runner, transformers' Trainer and TRL's trainers in the script build lowbit's Accelerator.
    runner = patching_wanted({**os.environ, **env}) and not no_python
    entry = [RUNNER, *target] if runner else [args.training_script]  # what torchrun runs (a module with the runner)
    # One process runs as a plain script; asked for MULTI_GPU (--multi_gpu), it runs under torchrun
    # and trains under DDP, as Accelerate does.
    if (
        launcher.num_processes == 1
        and config.distributed_type.upper() in SINGLE_PROCESS_TYPES
        and config.distributed_type.upper() != "MULTI_GPU"
    ):
        note_ignored("lowbit launch with one process", flags_without_torchrun(flags_for_torchrun(args), args))
        if no_python:
            return [str(script), *args.training_script_args], env, config
        return [sys.executable, *(["-m", RUNNER] if runner else []), *target, *args.training_script_args], env, config
    rendezvous = rendezvous_arguments(launcher, args)
    per_machine = launcher.num_processes // launcher.num_machines
    torchrun_options = flags_for_torchrun(args)
    if module or runner:
        torchrun_options.append("--module")
    elif no_python:
        torchrun_options.append("--no_python")
    if per_machine > 1 and "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads_per_process(per_machine))
        print(
            f"lowbit launch: {per_machine} processes share {os.cpu_count()} CPU cores: "
            f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} "
            "each (set OMP_NUM_THREADS or --num_cpu_threads_per_process to choose).",
            file=sys.stderr,
            flush=True,
        )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(per_machine),
        *torchrun_options,
        *rendezvous,
        *entry,
        *args.training_script_args,
    ]
    env.update(notices.said_env())  # the ranks do not repeat what the launcher said
    return command, env, config


def _one_job_of_the_cluster(cluster: "ClusterJob | None", config: "LowbitConfig", machines_from: str | None) -> None:
    """Stop a launch that would split the scheduler's job; say the layout read from the scheduler."""
    check_one_job(cluster, config.num_machines, machines_from)
    if cluster and machines_from is None and config.num_machines > 1:
        print(
            f"lowbit launch: {cluster.scheduler}: machine {config.machine_rank} of {config.num_machines}, "
            f"machine 0 at {config.main_process_ip}:{config.main_process_port} ({cluster.shown()}).",
            file=sys.stderr,
            flush=True,
        )
    alone = only_this_machine_note(cluster, config.num_machines)
    if alone:
        notices.note(alone)


def flags_for_torchrun(args: argparse.Namespace) -> list[str]:
    """The launcher flags given that torchrun takes as they are (``--rdzv_conf``, ``--tee``, ...)."""
    return [
        f"{option}={getattr(args, flag)}"
        for flag, option in TORCHRUN_FLAGS.items()
        if getattr(args, flag, None) is not None
    ]


def rendezvous_arguments(launcher: "LauncherSettings", args: argparse.Namespace) -> list[str]:
    """torchrun's options that make the machines one job.

    A static rendezvous numbers the machines by ``machine_rank``; c10d and etcd number them as
    they arrive, so there the rank is not passed (every machine may give 0, as Accelerate's Slurm
    example does). One machine gets a free port of its own unless one is given."""
    if launcher.num_machines == 1:
        port = launcher.main_process_port
        if port is None:
            port = _free_port()
        else:
            _check_port_free(port)
        return ["--nnodes", "1", "--master_addr", launcher.main_process_ip or "127.0.0.1", "--master_port", str(port)]
    check_multinode_launcher(args)
    if not launcher.main_process_ip:
        raise ConfigError(
            "A multi-machine launch needs --main_process_ip (the address of machine 0); under Slurm or a "
            "Kubeflow TrainJob lowbit reads it from the scheduler's variables."
        )
    port = launcher.main_process_port or 29500
    nodes = ["--nnodes", str(launcher.num_machines)]
    if launcher.rdzv_backend != "static":
        if launcher.rdzv_backend == "c10d":
            _check_c10d_endpoint(launcher.main_process_ip, port)
        return [
            *nodes,
            "--rdzv_backend",
            launcher.rdzv_backend,
            "--rdzv_endpoint",
            f"{launcher.main_process_ip}:{port}",
        ]
    if not 0 <= launcher.machine_rank < launcher.num_machines:
        raise ConfigError(
            f"--machine_rank {launcher.machine_rank} is not a machine of {launcher.num_machines} (0 to "
            f"{launcher.num_machines - 1}); or give --rdzv_backend c10d, which numbers the machines itself."
        )
    if launcher.machine_rank == 0:
        _check_port_free(port)
    return [
        *nodes,
        "--node_rank",
        str(launcher.machine_rank),
        "--master_addr",
        launcher.main_process_ip,
        "--master_port",
        str(port),
    ]


def _given_by(key: str, flags_raw: dict, env_raw: dict, file_raw: dict, path: Path) -> str | None:
    """Which of the user's sources set ``key`` (the highest), for messages; None: nobody did."""
    sources = ((flags_raw, f"--{key}"), (env_raw, f"LOWBIT_{key.upper()}"), (file_raw, f"the config file {path}"))
    return next((where for raw, where in sources if key in raw), None)


def _gpu_ids(given: str | None) -> list[str]:
    """``--gpu_ids``: "0,2" -> ["0", "2"]; "all" or nothing -> [] (every visible GPU)."""
    if given is None or given.strip().lower() == "all":
        return []
    ids = [part.strip() for part in str(given).split(",") if part.strip()]
    bad = [part for part in ids if not part.isdigit()]
    if bad or not ids:
        raise ConfigError(
            f"--gpu_ids {given!r} is not a list of GPU numbers: give them comma-separated, e.g. --gpu_ids 0,1 (or all)."
        )
    twice = sorted({part for part in ids if ids.count(part) > 1}, key=int)
    if twice:
        raise ConfigError(
            f"--gpu_ids {given!r} names GPU {', '.join(twice)} more than once: each process needs a GPU of "
            "its own (two ranks on one GPU fail in NCCL). Name each GPU once."
        )
    return ids


def _visible_gpu_count() -> int:
    """The GPUs this machine shows the job (torch counts without starting CUDA)."""
    import torch

    return torch.cuda.device_count()


def _check_strategy_installed(config: "LowbitConfig", registry: Any) -> None:
    """A distributed_type whose strategy is a first-party plugin that is absent: say what to install
    before any process starts."""
    if config.distributed_type.upper() in SINGLE_PROCESS_TYPES or registry.strategy_for(config.distributed_type):
        return
    plugin = first_party(config.distributed_type)
    if plugin:
        raise ConfigError(
            f"distributed_type {config.distributed_type} needs the {plugin!r} strategy plugin, which is not "
            f"installed: {install_command(plugin)}."
        )


def file_sources(file_raw: dict, overrides: dict, path: Path) -> dict[str, str]:
    """Which exported fp8 settings came from the config file (not a flag or a variable), so that an
    error in a rank names the file and key, not the variable the launcher passed it in."""
    from lowbit.kernel.recipes import fp8_env_var

    from lowbit.run.settings import SOURCES_ENV

    from_file = {key for key in (file_raw.get("fp8_config") or {}) if key not in (overrides.get("fp8_config") or {})}
    sources = {fp8_env_var(key): f"config file {path}, fp8_config.{key}" for key in sorted(from_file)}
    return {SOURCES_ENV: json.dumps(sources)} if sources else {}


def threads_per_process(processes: int) -> int:
    """The cores of this machine split evenly: more threads than cores make every process slower
    (torchrun alone would give each process 1 thread)."""
    return max(1, (os.cpu_count() or 1) // processes)


def run(args: argparse.Namespace) -> int:
    command, extra_env, config = build_command(args)
    if config.debug:
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra_env.items()))
        print(f"lowbit launch: running: {shown} {shlex.join(command)}", file=sys.stderr, flush=True)
    return run_job(command, {**os.environ, **extra_env})


# SIGUSR1 received between the launcher's start and the job's (hold_early_warnings): not lost.
EARLY_WARNINGS: list[int] = []


def hold_early_warnings() -> None:
    """From the launcher's first instant: a scheduler's SIGUSR1 is kept for the job (its default
    action would kill the launcher: exit -10 and no checkpoint)."""
    import signal

    signal.signal(signal.SIGUSR1, lambda signum, frame: EARLY_WARNINGS.append(signum))


def run_job(command: list[str], env: dict[str, str]) -> int:
    """Run the job; SIGTERM (and SIGINT) to the launcher reach every process of it, and what is
    still running a window later (``LOWBIT_PREEMPTION_GRACE`` seconds, 25 by default) is killed,
    so nothing outlives the launcher (see training/preemption.py). SIGUSR1, a scheduler's early
    warning, reaches every process too: the job starts with it ignored (torchrun and the loaders'
    workers would die of it), and lowbit's ranks take it over to checkpoint. A multi-process job
    (torchrun and its ranks) gets a process group of its own, so that all of it can be signalled;
    a one-process job stays in the terminal's group (so ``input()`` and ``pdb`` work, and Ctrl-C
    reaches it from the terminal directly)."""
    import signal
    import time

    from lowbit.kernel.preemption_window import GRACE_ENV, grace_seconds, warning_action

    grace = grace_seconds()
    own_group = "torch.distributed.run" in command

    def start_child() -> None:
        # os.setpgrp rather than Popen(process_group=0): that argument needs Python 3.11; lowbit runs on 3.10.
        if own_group:
            os.setpgrp()
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # kept across exec, by torchrun's workers too

    job = subprocess.Popen(command, env=env, preexec_fn=start_child)
    deadline: list[float] = []

    def send(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signum) if own_group else job.send_signal(signum)

    received: list[int] = []

    def forward(signum, frame):
        send(signum)
        received.append(signum)
        deadline.append(time.monotonic() + grace)

    def warn(signum, frame):
        # torchrun starts each rank in a session of its own: the ranks are told one by one, at any
        # depth (a --no_python wrapper runs Python as its child; the processes that do not listen
        # ignore it: the job started with it ignored).
        for pid in _descendants(job.pid) if own_group else [job.pid, *_descendants(job.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if warning_action() == "stop":  # the ranks save and stop as on SIGTERM (exit code 143)
            received.append(signal.SIGTERM)

    def kill_everything() -> None:
        # The ranks (torchrun starts each in a session of its own) and their children, found while
        # torchrun is alive (they are re-parented when it dies), then the job's own group.
        for pid in _descendants(job.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        send(signal.SIGKILL)

    def stopped(returncode: int) -> int:
        # torchrun reports ranks that exited 143 on the forwarded SIGTERM as a failure (1): the job
        # stopped as asked, and says so as a one-process job does, 128 + the signal.
        if received and own_group and returncode > 0:
            return 128 + received[0]
        return _exit_code(returncode)

    forwarded = (signal.SIGTERM, signal.SIGINT) if own_group else (signal.SIGTERM,)
    previous = {sig: signal.signal(sig, forward) for sig in forwarded}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, warn)
    if EARLY_WARNINGS:  # SIGUSR1 that came while the launcher was starting: passed on now
        EARLY_WARNINGS.clear()
        warn(signal.SIGUSR1, None)
    try:
        while True:
            try:
                return stopped(job.wait(timeout=0.5))
            except subprocess.TimeoutExpired:
                if deadline and time.monotonic() > deadline[0]:
                    print(
                        f"lowbit launch: the job did not stop within {grace:.0f} s of the signal "
                        f"({GRACE_ENV}); killing it.",
                        file=sys.stderr,
                        flush=True,
                    )
                    kill_everything()
                    return stopped(job.wait())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_group:  # a rank that outlived torchrun
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (children, theirs, ...), parents first."""
    found, frontier = [], [root]
    while frontier:
        children = [child for parent in frontier for child in _children(parent)]
        found.extend(children)
        frontier = children
    return found


def _children(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (Linux's /proc; none where it is missing)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:  # the field after the state
                found.append(int(stat.parent.name))
    return found


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode
