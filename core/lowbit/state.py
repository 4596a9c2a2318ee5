"""Process facts (ranks, device, process group) and Accelerate's state classes.

Only the process group is global, because torch.distributed makes it so: ``PartialState`` reads
the launcher's environment once per process and owns the group's life, including a safe exit.
Precision settings stay per Accelerator: ``accelerator.state`` is an :class:`AcceleratorState`
bound to that Accelerator, and ``AcceleratorState()`` built by hand sees only process facts.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import os
import sys
from typing import Any, Callable, Iterator

import torch

from lowbit.compat.accelerate_names import DistributedType  # noqa: F401 - Accelerate's name, public here as in Accelerate
from lowbit.errors import ConfigError, LowbitError


# How long a rank that finished normally waits at exit for the others before leaving anyway.
EXIT_BARRIER_TIMEOUT = datetime.timedelta(seconds=120)


# ---------------------------------------------------------------------- the process group


_uncaught: list[BaseException] = []


def _record_uncaught(previous: Callable[..., Any]) -> Callable[..., Any]:
    def hook(exc_type, exc, tb):  # noqa: ANN001 - sys.excepthook's signature
        _uncaught.append(exc)
        previous(exc_type, exc, tb)
        from lowbit.collective_timeouts import report_if_timeout

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
    _GROUP["timeout"] = options.get("timeout")
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
            print(f"lowbit: the other ranks did not reach the end of the script within "
                  f"{EXIT_BARRIER_TIMEOUT.total_seconds():.0f} s ({exc}); leaving without them.", file=sys.stderr)
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


# ---------------------------------------------------------------------- PartialState


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, default)
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"Environment variable {name}={value!r} must be a whole number (torchrun and lowbit launch set it).") from None
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


def process_facts(device_type: str, device_count: int, group_options: dict | None = None) -> ProcessFacts:
    """Read the ranks torchrun (or ``lowbit launch``) set; this process's device is the
    ``local_rank``-th of ``device_count`` devices of ``device_type`` (CUDA devices are also made
    current). Several processes join the job's process group."""
    world = _env_int("WORLD_SIZE", 1)
    local = _env_int("LOCAL_RANK", 0)
    rank = _env_int("RANK", 0)
    if world < 1 or rank >= world:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} do not fit together: a rank is 0 to WORLD_SIZE - 1 "
                          "(started by hand? `lowbit launch` sets both).")
    if device_type == "cuda":
        device = torch.device("cuda", local % max(device_count, 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if world > 1:
        init_process_group(device.type, group_options)
    return ProcessFacts(world, rank, local, device)


def wait_for_everyone() -> None:
    """A barrier over the job's processes (nothing to wait for in one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# What this process's group was started with (the timeout barriers wait for).
_GROUP: dict[str, Any] = {"timeout": None}


def every_rank_must_arrive(what: str) -> None:
    """A barrier for calls every rank must make together (``save_state``, ``load_state``). Over
    gloo it is torch's monitored barrier: a rank that never arrives (``save_state`` called under
    ``if accelerator.is_main_process``) ends the wait after the process group's timeout
    (``InitProcessGroupKwargs(timeout=...)``, torch's default otherwise) with an error naming the
    ranks that did not come, instead of a hang. Over NCCL, which has no monitored barrier, a plain one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if dist.get_backend() != "gloo":
        dist.barrier()
        return
    try:
        dist.monitored_barrier(timeout=_GROUP["timeout"], wait_all_ranks=True)
    except RuntimeError as exc:
        raise LowbitError(
            f"{what} must be called on every process at the same point, but not every rank arrived: "
            f"{str(exc).splitlines()[0]}. Call it outside `if accelerator.is_main_process:` (every rank saves its "
            "own part; lowbit writes the shared files once).") from None


class PartialState(RankFacts):
    """Where this process stands in the job: ranks, device, process group.

    Every instance in a process shares one state (the process group is process-wide). Built
    with ``cpu=True`` it keeps to the CPU. ``_reset_state()`` forgets the shared state (tests).
    """

    _shared: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = PartialState._shared
        if self._shared:
            return
        use_cuda = torch.cuda.is_available() and not cpu and not _truthy(os.environ.get("ACCELERATE_USE_CPU"))
        facts = process_facts("cuda" if use_cuda else "cpu", torch.cuda.device_count() if use_cuda else 1)
        self.num_processes, self.process_index = facts.num_processes, facts.process_index
        self.local_process_index, self.device = facts.local_process_index, facts.device
        self.backend = ("nccl" if use_cuda else "gloo") if self.num_processes > 1 else None
        self.debug = _truthy(os.environ.get("ACCELERATE_DEBUG_MODE"))

    @staticmethod
    def _reset_state() -> None:
        PartialState._shared.clear()

    @property
    def initialized(self) -> bool:
        return bool(self._shared)

    @property
    def distributed_type(self) -> DistributedType:
        if self.num_processes == 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def default_device(self) -> torch.device:
        return self.device

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type.value}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")

    # -------------------------------------------------------------- synchronising

    def wait_for_everyone(self) -> None:
        wait_for_everyone()

    @contextlib.contextmanager
    def _first(self, goes_first: bool) -> Iterator[None]:
        if not goes_first:
            self.wait_for_everyone()
        yield
        if goes_first:
            self.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """The main process runs the block first (e.g. to download or preprocess), then the rest."""
        return self._first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Like main_process_first, once per machine."""
        return self._first(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor or dict of them; the first
        ``len % num_processes`` processes get one extra. ``apply_padding`` repeats the last item so
        every process gets as many (to gather afterwards; drop the padding yourself)."""
        if self.num_processes == 1:
            yield inputs
            return
        length = _shared_length(inputs)
        base, extra = divmod(length, self.num_processes)
        start = self.process_index * base + min(self.process_index, extra)
        end = start + base + (1 if self.process_index < extra else 0)
        share = base + (1 if extra else 0)
        yield _slice(inputs, start, end, share if apply_padding else None)

    # -------------------------------------------------------------- running on some processes

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Callable[..., Any]:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable[..., Any] | None = None, local_process_index: int | None = None) -> Callable[..., Any]:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_if(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _only_if(function: Callable[..., Any], condition: Callable[[], bool]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if condition() else None

        return wrapper

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        if self.use_distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group(group)


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


def _shared_length(inputs: Any) -> int:
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(f"split_between_processes needs every value of the dict to have the same length, got {sorted(lengths)}.")
        return lengths.pop() if lengths else 0
    return len(inputs)


def _slice(inputs: Any, start: int, end: int, pad_to: int | None) -> Any:
    if isinstance(inputs, dict):
        return {k: _slice(v, start, end, pad_to) for k, v in inputs.items()}
    part = inputs[start:end]
    if pad_to is None or len(part) >= pad_to or len(inputs) == 0:
        return part
    missing = pad_to - len(part)
    if isinstance(part, torch.Tensor):
        return torch.cat([part, inputs[-1:].expand(missing, *inputs.shape[1:])])
    return part + type(part)([inputs[-1]] * missing)


# ---------------------------------------------------------------------- AcceleratorState


class AcceleratorState:
    """Accelerate's ``AcceleratorState``: process facts plus one Accelerator's settings.

    In lowbit the settings belong to an Accelerator (``accelerator.state``), not to the process,
    so two Accelerators with different precisions can live side by side. Built by hand,
    ``AcceleratorState()`` sees the process facts and ``mixed_precision`` "no".
    ``_reset_state()`` exists for scripts written against Accelerate's singleton; there is no
    global precision to reset, so it only forgets the process facts when asked to.
    """

    def __init__(self, accelerator: Any = None, cpu: bool = False, **kwargs: Any) -> None:
        self._accelerator = accelerator
        self._partial = PartialState(cpu=cpu)

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        if reset_partial_state:
            PartialState._reset_state()

    @property
    def initialized(self) -> bool:
        return self._partial.initialized

    @property
    def mixed_precision(self) -> str:
        return self._accelerator.mixed_precision if self._accelerator is not None else "no"

    @property
    def distributed_type(self) -> DistributedType:
        if self._accelerator is not None:
            return self._accelerator.distributed_type
        return self._partial.distributed_type

    @property
    def device(self) -> torch.device:
        return self._accelerator.device if self._accelerator is not None else self._partial.device

    @property
    def num_processes(self) -> int:
        return self._partial.num_processes

    @property
    def deepspeed_plugin(self) -> Any:
        return self._accelerator.deepspeed_plugin if self._accelerator is not None else None

    @property
    def fsdp_plugin(self) -> Any:
        return self._accelerator.fsdp_plugin if self._accelerator is not None else None

    @property
    def dynamo_plugin(self) -> Any:
        return self._accelerator.dynamo_plugin if self._accelerator is not None else None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._partial, name)

    def __repr__(self) -> str:
        return f"{self._partial!r}Mixed precision type: {self.mixed_precision}\n"


# Where the dataloader being iterated stands, for the whole process as in Accelerate: a loader
# prepared by one Accelerator and gathered by another (Accelerate's fp8 benchmarks do this) still
# drops its padding in gather_for_metrics.
_DATALOADER_POSITION: dict[str, Any] = {"end_of_dataloader": False, "remainder": -1}


def _process_wide(key: str) -> property:
    """An attribute kept in ``_DATALOADER_POSITION``, shared by every GradientState."""
    return property(lambda self: _DATALOADER_POSITION[key], lambda self, value: _DATALOADER_POSITION.__setitem__(key, value))


class GradientState:
    """Accelerate's ``GradientState``: whether this Accelerator's micro-batch syncs gradients, and
    whether the dataloader being iterated (in this process) just yielded its last batch."""

    def __init__(self, accelerator: Any = None, gradient_accumulation_plugin: Any = None) -> None:
        self._accelerator = accelerator
        self.sync_gradients = True

    end_of_dataloader = _process_wide("end_of_dataloader")
    remainder = _process_wide("remainder")

    @property
    def num_steps(self) -> int:
        return self._accelerator.gradient_accumulation_steps if self._accelerator is not None else 1

    @property
    def sync_with_dataloader(self) -> bool:
        return True

    @staticmethod
    def _reset_state() -> None:
        """Nothing is global in lowbit; kept for scripts that call it."""
