"""``accelerate launch``'s flags that are not settings, and how ``lowbit launch`` takes each one.

A cluster script copied from another project passes them; each is either

- handed to torchrun with its meaning (``TORCHRUN_FLAGS``: the rendezvous options, ``--role``,
  ``--tee``, ``--log_dir``, restarts);
- accepted with no effect and named in a note (``WITHOUT_EFFECT``: it tunes something lowbit does
  its own way, or hardware lowbit does not run on);
- or refused by name with what to use instead (``REFUSED``: Megatron-LM, TPU, SageMaker, mpirun),
  never "unrecognized argument".

Accelerate's hyphenated spellings (``--num-processes``) are accepted as well.
``tests/core/cli/test_launcher_flag_census.py`` holds the installed Accelerate's whole list
against lowbit's.
"""

from __future__ import annotations

import argparse
from typing import Any

from lowbit.kernel.errors import ConfigError

from lowbit.run.accelerate_config import DEEPSPEED_IGNORED

# lowbit launch's flag -> torchrun's option (torch/distributed/run.py), for a multi-process job.
TORCHRUN_FLAGS = {
    "rdzv_conf": "--rdzv_conf",
    "role": "--role",
    "tee": "--tee",
    "log_dir": "--log_dir",
    "max_restarts": "--max_restarts",
    "monitor_interval": "--monitor_interval",
}
TORCHRUN_HELP = {
    "rdzv_conf": "more rendezvous settings for torchrun, key=value,key=value (e.g. join_timeout=900)",
    "role": "the workers' role name in torchrun's logs",
    "tee": "copy the ranks' stdout/stderr to files in --log_dir as well (0 none, 1 out, 2 err, 3 both; or per rank)",
    "log_dir": "where torchrun writes the ranks' logs",
    "max_restarts": "torchrun restarts of a failed job (default 0); see docs/cluster.md for resuming",
    "monitor_interval": "seconds between torchrun's checks of the workers",
}
TORCHRUN_TYPES = {"max_restarts": int, "monitor_interval": float}
# The smallest value torchrun works with, per numeric flag (and whether the smallest is excluded).
TORCHRUN_MINIMUM = {"max_restarts": (0, False), "monitor_interval": (0.0, True)}


def check_torchrun_values(args: Any) -> None:
    """A numeric torchrun flag out of its range is an error naming it (torchrun would fail later,
    with a traceback: a negative monitor interval in its agent's sleep)."""
    import math

    for flag, (minimum, excluded) in TORCHRUN_MINIMUM.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if math.isnan(value) or value < minimum or (excluded and value == minimum):
            wanted = f"more than {minimum:g}" if excluded else f"at least {minimum:g}"
            raise ConfigError(f"--{flag} {value:g}: it takes a number {wanted} ({TORCHRUN_HELP[flag]}).")


SHORT_FLAGS = {"tee": "-t", "quiet": "-q"}

# DeepSpeed's multi-machine launchers that start every machine from one command (over ssh, MPI or
# Slurm). lowbit launch starts the machine it runs on, through torchrun, as Accelerate's
# "standard" launcher does; DeepSpeed's "nossh" is the same shape.
ONE_MACHINE_LAUNCHERS = ("standard", "nossh")

_ULYSSES = "they tune DeepSpeed's sequence parallelism, which lowbit refuses (sp_size > 1) at the Accelerator"
# Accepted switches (no value) and valued flags that change nothing in lowbit, with why.
WITHOUT_EFFECT_SWITCHES = {
    "same_network": "torchrun's rendezvous reaches machine 0 either way",
    "downcast_bf16": "a TPU setting",
    "enable_cpu_affinity": "lowbit leaves CPU affinity to the system",
    "quiet": "lowbit launch prints no stack trace of its own; each rank's error is shown as it is",
    "use_parallelism_config": "the --parallelism_config_* flags take effect by themselves",
}
WITHOUT_EFFECT = {
    "main_training_function": "a TPU setting",
    "parallelism_config_sp_seq_length": _ULYSSES,
    "parallelism_config_sp_seq_length_is_variable": _ULYSSES,
    "parallelism_config_sp_attn_implementation": _ULYSSES,
    # the DeepSpeed keys that Accelerate's config files hold too, with the same reason
    **{key: why for key, why in DEEPSPEED_IGNORED.items() if key != "deepspeed_multinode_launcher"},
    **WITHOUT_EFFECT_SWITCHES,
}

_TPU = "lowbit trains on CUDA GPUs and CPUs, not TPUs: use accelerate launch for TPU jobs"
_SAGEMAKER = "lowbit launch does not start SageMaker jobs: run lowbit launch inside the SageMaker training job"
# Flag (or a prefix ending in "_") -> why lowbit refuses it and what to use.
REFUSED = {
    "use_megatron_lm": "Megatron-LM is not supported by lowbit: use --use_fsdp or --use_deepspeed",
    "megatron_lm_": "Megatron-LM is not supported by lowbit: use --use_fsdp or --use_deepspeed",
    "tpu": _TPU,
    "tpu_cluster": _TPU,
    "no_tpu_cluster": _TPU,
    "tpu_use_sudo": _TPU,
    "vm": _TPU,
    "env": _TPU + " (--env sets variables on TPU pod VMs)",
    "aws_access_key_id": _SAGEMAKER,
    "aws_secret_access_key": _SAGEMAKER,
    "mpirun_hostfile": "lowbit launch starts CPU machines through torchrun, not mpirun: run lowbit launch --cpu on "
    "each machine with --num_machines, --machine_rank and --main_process_ip (or under srun, which lowbit reads)",
}


def add_launcher_flags(group: Any, parser: argparse.ArgumentParser) -> None:
    """The flags above that the launcher reads (the refused ones are answered by :func:`refusal`)."""
    for flag, help_text in TORCHRUN_HELP.items():
        names = [f"--{flag}", *([SHORT_FLAGS[flag]] if flag in SHORT_FLAGS else [])]
        group.add_argument(*names, type=TORCHRUN_TYPES.get(flag, str), default=None, help=help_text)
    group.add_argument(
        "--no_python",
        action="store_true",
        help="run the script as a program, not with python (torchrun's --no-python); not with -m",
    )
    group.add_argument(
        "--deepspeed_multinode_launcher",
        default=None,
        help=f"with several machines: {' or '.join(ONE_MACHINE_LAUNCHERS)} (lowbit launch runs on every machine); "
        "DeepSpeed's launchers that start all machines from one (pdsh, openmpi, slurm, ...) are refused",
    )
    for flag, reason in WITHOUT_EFFECT.items():
        if f"--{flag}" in parser._option_string_actions:  # a plugin reads it (lowbit-deepspeed's flags)
            continue
        names = [f"--{flag}", *([SHORT_FLAGS[flag]] if flag in SHORT_FLAGS else [])]
        switch = {"action": "store_true"} if flag in WITHOUT_EFFECT_SWITCHES else {}
        group.add_argument(*names, default=None, help=argparse.SUPPRESS, **switch)


def multinode_launcher(args: argparse.Namespace) -> str | None:
    launcher = getattr(args, "deepspeed_multinode_launcher", None)
    return launcher.strip().lower() if launcher else None


def check_multinode_launcher(args: argparse.Namespace) -> None:
    """A multi-machine launch: DeepSpeed's launchers that start every machine from one are refused."""
    launcher = multinode_launcher(args)
    if launcher and launcher not in ONE_MACHINE_LAUNCHERS:
        raise ConfigError(
            f"--deepspeed_multinode_launcher {launcher} starts every machine from one command; lowbit launch "
            f"starts the machine it runs on, through torchrun. Run lowbit launch on each machine (under Slurm: "
            f"`srun --ntasks-per-node=1 lowbit launch ...`, which lowbit reads), and give "
            f"--deepspeed_multinode_launcher {ONE_MACHINE_LAUNCHERS[0]} or leave it out."
        )


def flags_without_torchrun(torchrun_flags: list[str], args: argparse.Namespace) -> list[str]:
    """What a one-process launch (no torchrun) names as without effect."""
    given = [*torchrun_flags, *(["--deepspeed_multinode_launcher"] if multinode_launcher(args) else [])]
    return [f"{flag} (torchrun's; no torchrun runs)" for flag in given]


def flags_without_effect(args: argparse.Namespace) -> list[str]:
    return [f"--{flag} ({reason})" for flag, reason in WITHOUT_EFFECT.items() if getattr(args, flag, None)]


def refusal(flag: str) -> str | None:
    """Why ``flag`` (as typed, any spelling) is refused, or None for a flag lowbit does not know."""
    name = flag.split("=")[0].lstrip("-").replace("-", "_")
    if name in REFUSED:
        return REFUSED[name]
    return next((why for prefix, why in REFUSED.items() if prefix.endswith("_") and name.startswith(prefix)), None)


def accept_hyphenated_spellings(parser: argparse.ArgumentParser) -> None:
    """Accelerate's launcher takes ``--num-processes`` for ``--num_processes``; so does lowbit's."""
    for action in list(parser._actions):
        for flag in list(action.option_strings):
            alias = "--" + flag[2:].replace("_", "-")
            if flag.startswith("--") and alias not in parser._option_string_actions:
                action.option_strings.append(alias)
                parser._option_string_actions[alias] = action
