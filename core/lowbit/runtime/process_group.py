"""The job's processes: where this one stands (ranks from the launcher's environment, its
device) and the process group's life (joining it, barriers, leaving it without hanging a job).

Only the process group is global, because torch.distributed makes it so. Accelerate's state
classes (``lowbit.compat.state``) and the Accelerator read their facts from here.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import sys
import time
from typing import Any, Callable

import torch

from lowbit.kernel.env_numbers import env_number
from lowbit.kernel.errors import ConfigError, LowbitError

from lowbit.runtime.collective_device import hold_to_nccl_rules

# How long a rank that finished normally waits at exit for the others before leaving anyway.
EXIT_BARRIER_TIMEOUT = datetime.timedelta(seconds=120)


# ---------------------------------------------------------------------- the process group


_uncaught: list[BaseException] = []


def _record_uncaught(previous: Callable[..., Any]) -> Callable[..., Any]:
    def hook(exc_type, exc, tb):  # noqa: ANN001 - sys.excepthook's signature
        _uncaught.append(exc)
        previous(exc_type, exc, tb)
        from lowbit.runtime.collective_timeouts import report_if_timeout

        report_if_timeout(exc)

    hook._lowbit = True  # type: ignore[attr-defined]
    return hook


def _dying_of_an_exception() -> bool:
    return bool(_uncaught) or getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def init_process_group(device_type: str, options: dict | None = None) -> None:
    """Join the job's process group (gloo on CPU, nccl on CUDA, unless ``options`` name a backend;
    ``options``: InitProcessGroupKwargs' backend, init_method and timeout) and arrange a safe exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if isinstance(options.get("timeout"), (int, float)):
        options["timeout"] = datetime.timedelta(seconds=options["timeout"])
    backend = options.pop("backend", None) or ("nccl" if device_type == "cuda" else "gloo")
    dist.init_process_group(backend, **options)
    if not getattr(sys.excepthook, "_lowbit", False):
        sys.excepthook = _record_uncaught(sys.excepthook)
    atexit.register(leave_process_group)


def leave_process_group() -> None:
    """At exit, leave the process group together with the other ranks, and never hang a failed job.

    After an uncaught exception the other ranks may be waiting in a collective with this one:
    a barrier here would pair with their all-reduce and hang the job until gloo's 30-minute
    timeout, and so would interpreter shutdown, which joins gloo's worker threads while one of
    them still waits on a peer. So a failing rank flushes its output and leaves at once with
    exit status 1; the launcher then stops the other ranks. A rank that finished normally waits
    at most EXIT_BARRIER_TIMEOUT for the others, then destroys the group; if they never come, it
    leaves the same way as a failing rank.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if not _dying_of_an_exception():
        try:
            dist.barrier(async_op=True).wait(timeout=EXIT_BARRIER_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a peer is gone or stuck
            print(
                f"lowbit: the other ranks did not reach the end of the script within "
                f"{EXIT_BARRIER_TIMEOUT.total_seconds():.0f} s ({exc}); leaving without them.",
                file=sys.stderr,
            )
        else:
            dist.destroy_process_group()
            wait_for_native_threads_to_settle()
            return
    _exit_now(1)


def wait_for_native_threads_to_settle(timeout: float = 2.0, interval: float = 0.02, quiet_samples: int = 3) -> bool:
    """Before interpreter shutdown, give torch's C++ threads the GIL-free moment they need to finish.

    Why: after DDP or FSDP2 the gloo process group outlives ``destroy_process_group`` (the model
    holds it), so its worker threads live on into interpreter shutdown. A worker that is still
    dropping the last reference to a Python-owned object needs the GIL; if it gets it once
    shutdown has begun, CPython 3.11 ends the thread with ``pthread_exit``, whose unwinding through
    a C++ ``noexcept`` frame aborts the process ("terminate called without an active exception",
    exit -6), after the script finished. Seen under load, with faulthandler showing the main
    thread in shutdown (no Python frame) and the abort in a thread Python does not own. So: sleep
    (releasing the GIL) until no other thread of this process is running, for a few samples in a
    row, or ``timeout`` seconds. Returns True when the threads settled.
    """
    import time

    deadline = time.monotonic() + timeout
    calm = 0
    while time.monotonic() < deadline:
        time.sleep(interval)
        calm = calm + 1 if not _other_threads_running() else 0
        if calm >= quiet_samples:
            return True
    return False


def _other_threads_running() -> bool:
    """Whether a thread of this process other than the calling one is running (state R in
    /proc); False where /proc is not available (nothing to wait for that can be seen)."""
    import threading

    me = threading.get_native_id()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tasks:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state == "R":
            return True
    return False


def _exit_now(status: int) -> None:
    """Exit without interpreter shutdown, after flushing what a user would lose."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to lose
            pass
    os._exit(status)


# ---------------------------------------------------------------------- where this process stands


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, default)
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(
            f"Environment variable {name}={value!r} must be a whole number (torchrun and lowbit launch set it)."
        ) from None
    if number < 0:
        raise ConfigError(f"Environment variable {name}={value!r} must not be negative.")
    return number


class RankFacts:
    """Predicates on ``num_processes``, ``process_index`` and ``local_process_index``, shared by
    PartialState and the Accelerator (both hold those three numbers)."""

    num_processes: int
    process_index: int
    local_process_index: int

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1


@dataclasses.dataclass(frozen=True)
class ProcessFacts(RankFacts):
    """Where this process stands: ranks from the launcher's environment, and its device. Made by
    :func:`process_facts`, the one place both the Accelerator and PartialState get them from."""

    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device


# Names this process's device outright (Accelerate's variable; e.g. "cuda:3").
DEVICE_ENV = "ACCELERATE_TORCH_DEVICE"


def process_facts(
    device_type: str, device_count: int, group_options: dict | None = None, group_of_one: bool = False
) -> ProcessFacts:
    """Read the ranks torchrun (or ``lowbit launch``) set, or, without them, from the process group
    the script (or Accelerate's ``debug_launcher``) started itself; this process's device is
    the ``local_rank``-th of ``device_count`` devices of ``device_type`` (CUDA devices are also made
    current). Several processes join the job's process group; so does one started by a launcher
    with ``group_of_one``, for a strategy that needs a group (``--multi_gpu`` or ``--use_fsdp``
    with ``--num_processes 1``: DDP or FSDP2 on one GPU, as in Accelerate)."""
    import torch.distributed as dist

    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    if not launched and dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        local = _env_int("LOCAL_RANK", rank)  # no launcher variable: one machine
    else:
        world, local, rank = _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0), _env_int("RANK", 0)
    if world < 1 or rank >= world:
        raise ConfigError(
            f"RANK={rank} and WORLD_SIZE={world} do not fit together: a rank is 0 to WORLD_SIZE - 1 "
            "(started by hand? `lowbit launch` sets both)."
        )
    override = os.environ.get(DEVICE_ENV)
    if override:  # Accelerate's variable naming the device outright
        device = torch.device(override)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    elif device_type == "cuda":
        _refuse_ranks_sharing_a_gpu(device_count)
        device = torch.device("cuda", local % max(device_count, 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if world > 1 or (group_of_one and launched):
        init_process_group(device.type, group_options)
        hold_to_nccl_rules()
    return ProcessFacts(world, rank, local, device)


def _refuse_ranks_sharing_a_gpu(device_count: int) -> None:
    """More processes on this machine than the GPUs they all see would put two ranks on one GPU
    (rank % GPUs), which NCCL refuses later ("Duplicate GPU") or which runs out of memory. One GPU
    each by CUDA_VISIBLE_DEVICES (a scheduler's per-task GPUs) is fine: each sees one."""
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    per_process_gpu = device_count == 1 and "CUDA_VISIBLE_DEVICES" in os.environ
    if device_count and local_world > device_count and not per_process_gpu:
        raise ConfigError(
            f"{local_world} processes on this machine but they see {device_count} GPU(s): two ranks would share a GPU "
            "(NCCL refuses that). Start one process per GPU (lowbit launch --num_processes "
            f"{device_count}), or give each its own GPU (--gpu_ids with as many ids as processes)."
        )


def wait_for_everyone() -> None:
    """A barrier over the job's processes (nothing to wait for in one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# How long ``every_rank_must_arrive`` waits for the last rank (LOWBIT_ARRIVAL_TIMEOUT, seconds): in a
# correct script every rank reaches save_state within moments of the others.
ARRIVAL_TIMEOUT_ENV = "LOWBIT_ARRIVAL_TIMEOUT"
DEFAULT_ARRIVAL_TIMEOUT = 60.0
_arrivals = {"count": 0}


def arrival_timeout() -> float:
    return env_number(ARRIVAL_TIMEOUT_ENV, DEFAULT_ARRIVAL_TIMEOUT, above_minimum=True, meaning="seconds")


def every_rank_must_arrive(what: str) -> None:
    """A check-in for calls every rank must make together (``save_state``, ``load_state``), through
    the job's store (any backend: gloo, NCCL): a rank that does not arrive within
    ``LOWBIT_ARRIVAL_TIMEOUT`` seconds (60; ``save_state`` called under ``if
    accelerator.is_main_process``) ends the wait with an error naming the missing ranks and the
    fix, instead of a hang until the process group's timeout (30 minutes by default on gloo)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store, world, rank = _get_default_store(), dist.get_world_size(), dist.get_rank()
    _arrivals["count"] += 1  # every rank makes these calls in the same order: one key set per call
    keys = [f"lowbit/arrived/{_arrivals['count']}/{r}" for r in range(world)]
    store.set(keys[rank], what)
    timeout = arrival_timeout()
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
            raise LowbitError(
                f"{what} must be called on every process at the same point, but not every rank arrived: rank(s) "
                f"{', '.join(missing)} did not come within {timeout:g} s. Call it outside `if "
                "accelerator.is_main_process:` (every rank saves its own part; lowbit writes the shared files once); "
                "if a "
                "rank is rightly busy that long first (work on the main process only), set "
                f"{ARRIVAL_TIMEOUT_ENV}=<seconds>."
            )
        time.sleep(0.01)
