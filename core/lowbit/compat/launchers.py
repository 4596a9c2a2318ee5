"""Accelerate's launchers: run a training function in several processes from Python (a notebook, a
test), without ``lowbit launch``.

``debug_launcher`` runs it on the CPU in ``num_processes`` processes over gloo (to debug a
distributed script on a laptop); ``notebook_launcher`` runs it on each GPU of this machine (or, with
none, on the CPU like ``debug_launcher``). Each process gets the variables torchrun would set.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

from lowbit.kernel.errors import ConfigError

from lowbit.runtime.gpu_count import count_gpus_without_cuda_here


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_one(rank: int, function: Callable, args: tuple, world: int, env: dict[str, str]) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    function(*args)


def _start(function: Callable, args: tuple, processes: int, env: dict[str, str]) -> None:
    import torch
    import torch.multiprocessing as mp

    if processes < 1:
        raise ConfigError(f"num_processes must be at least 1, got {processes}.")
    # fork, as Accelerate: a function defined in a notebook cell (or a script read from stdin) lives
    # in a __main__ that a spawned process cannot import. A forked child cannot use CUDA once the
    # parent started it, so that is refused here, before any process starts.
    if torch.cuda.is_initialized():
        raise ConfigError(
            "CUDA is already in use in this process (a tensor or model was put on a GPU, or a torch.cuda call "
            "made, before the launcher), so the processes it forks could not use the GPUs. Restart the notebook's "
            "kernel and call the launcher before anything touches CUDA: create the model and move it to the "
            "device inside the training function."
        )
    mp.start_processes(_run_one, args=(function, tuple(args), processes, env), nprocs=processes, start_method="fork")


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """``function(*args)`` in ``num_processes`` CPU processes over gloo; raises when one of them does."""
    _start(
        function,
        args,
        num_processes,
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "LOWBIT_USE_CPU": "true"},
    )


def notebook_launcher(
    function: Callable,
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    **launcher_options: Any,
) -> None:
    """``function(*args)`` on every GPU of this machine (or ``num_processes`` of them); on a machine
    without one, ``num_processes`` CPU processes (1 if not given, run here). Multi-machine and
    elastic options (``num_nodes > 1``, rendezvous settings) are refused: use ``lowbit launch``."""
    if (
        num_nodes != 1
        or node_rank != 0
        or any(v not in (None, "", 0, 0.1, "static", "none") for v in launcher_options.values())
    ):
        raise ConfigError(
            "notebook_launcher runs on this machine only; for several machines use `lowbit launch "
            "--num_machines N --machine_rank R --main_process_ip ...`."
        )
    env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(use_port), "LOWBIT_MIXED_PRECISION": mixed_precision}
    gpus = count_gpus_without_cuda_here()  # not torch.cuda.is_available(): the children it forks could not use CUDA
    if gpus:
        _start(function, args, num_processes or gpus, env)
    elif (num_processes or 1) == 1:
        os.environ.update({"LOWBIT_MIXED_PRECISION": mixed_precision})
        function(*args)
    else:
        _start(function, args, num_processes, {**env, "LOWBIT_USE_CPU": "true"})
