"""Accelerate's state classes (``PartialState``, ``AcceleratorState``, ``GradientState``) over
lowbit's process facts (:mod:`lowbit.runtime.process_group`).

``PartialState`` reads the launcher's environment once per process, as Accelerate's does.
Precision settings stay per Accelerator: ``accelerator.state`` is an :class:`AcceleratorState`
bound to that Accelerator, and ``AcceleratorState()`` built by hand sees only process facts.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import torch

from lowbit.kernel.env_numbers import accelerate_flag

from lowbit.runtime.collective_device import SHAPE_CHECKS
from lowbit.runtime.process_group import RankFacts, process_facts, wait_for_everyone
from lowbit.runtime.training.gradient_sync import (
    ITERATED_LOADERS,
    GradientSync,
    active_loader,
    loader_ended,
    loader_started,
)

from lowbit.compat.accelerate_names import DistributedType  # noqa: F401 - Accelerate's name, public here as in Accelerate


class PartialState(RankFacts):
    """Where this process stands in the job: ranks, device, process group.

    Every instance in a process shares one state (the process group is process-wide). Built
    with ``cpu=True`` it keeps to the CPU. ``_reset_state()`` forgets the shared state (tests).
    """

    _shared_state: dict[str, Any] = {}  # Accelerate's name: transformers' use_configured_state reads it

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = PartialState._shared_state
        if self._shared_state:
            return
        use_cuda = torch.cuda.is_available() and not cpu and not accelerate_flag("ACCELERATE_USE_CPU")
        facts = process_facts("cuda" if use_cuda else "cpu", torch.cuda.device_count() if use_cuda else 1)
        self.num_processes, self.process_index = facts.num_processes, facts.process_index
        self.local_process_index, self.device = facts.local_process_index, facts.device
        self.backend = ("nccl" if use_cuda else "gloo") if self.num_processes > 1 else None

    @staticmethod
    def _reset_state() -> None:
        PartialState._shared_state.clear()

    @property
    def debug(self) -> bool:
        """Whether collectives compare their tensors' shapes across processes first (raising
        DistributedOperationException on a mismatch): ``ACCELERATE_DEBUG_MODE=1``, or set here."""
        return SHAPE_CHECKS["on"]

    @debug.setter
    def debug(self, on: bool) -> None:
        SHAPE_CHECKS["on"] = bool(on)

    @property
    def initialized(self) -> bool:
        return bool(self._shared_state)

    @property
    def distributed_type(self) -> DistributedType:
        if self.num_processes == 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def default_device(self) -> torch.device:
        return self.device

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}\nNum processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

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
        """This process's contiguous share of a list, tuple, tensor, Hugging Face Dataset or dict of them; the first
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

    def on_process(
        self, function: Callable[..., Any] | None = None, process_index: int | None = None
    ) -> Callable[..., Any]:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Callable[..., Any]:
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

    @property
    def fork_launched(self) -> bool:
        """Whether ``notebook_launcher`` forked this process (``FORK_LAUNCHED``)."""
        return accelerate_flag("FORK_LAUNCHED")

    def set_device(self) -> None:
        """Make this process's device the current one (its GPU, under CUDA); the device itself was
        settled when the state was made."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)


def _shared_length(inputs: Any) -> int:
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                f"split_between_processes needs every value of the dict to have the same length, got {sorted(lengths)}."
            )
        return lengths.pop() if lengths else 0
    return len(inputs)


def _slice(inputs: Any, start: int, end: int, pad_to: int | None) -> Any:
    if isinstance(inputs, dict):
        return {k: _slice(v, start, end, pad_to) for k, v in inputs.items()}
    if callable(getattr(inputs, "select", None)) and type(inputs).__module__.split(".")[0] == "datasets":
        # A Hugging Face Dataset: sliced by rows (its [a:b] gives a dict of columns), padded with its last row
        missing = max((pad_to or 0) - (end - start), 0) if len(inputs) else 0
        return inputs.select([*range(start, end), *[len(inputs) - 1] * missing])
    part = inputs[start:end]
    if pad_to is None or len(part) >= pad_to or len(inputs) == 0:
        return part
    missing = pad_to - len(part)
    if isinstance(part, torch.Tensor):
        return torch.cat([part, inputs[-1:].expand(missing, *inputs.shape[1:])])
    return part + type(part)([inputs[-1]] * missing)


# ---------------------------------------------------------------------- AcceleratorState


def _no_owner() -> None:
    return None


def _weak(accelerator: Any) -> Any:
    """A weak reference to the Accelerator a state object describes: the state lives as long as
    the Accelerator and keeps it alive no longer (no reference cycle to wait for the collector)."""
    return weakref.ref(accelerator) if accelerator is not None else _no_owner


class AcceleratorState:
    """Accelerate's ``AcceleratorState``: process facts plus one Accelerator's settings.

    In lowbit the settings belong to an Accelerator (``accelerator.state``), not to the process,
    so two Accelerators with different precisions can live side by side. Built by hand,
    ``AcceleratorState()`` sees the process facts and ``mixed_precision`` "no".
    ``_reset_state()`` exists for scripts written against Accelerate's singleton; there is no
    global precision to reset, so it only forgets the process facts when asked to.
    """

    def __init__(self, accelerator: Any = None, cpu: bool = False, **kwargs: Any) -> None:
        self._owner = _weak(accelerator)
        self._partial = PartialState(cpu=cpu)

    @property
    def _accelerator(self) -> Any:
        return self._owner()

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

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP

    @property
    def device_mesh(self) -> Any:
        return self._accelerator.torch_device_mesh if self._accelerator is not None else None

    @property
    def parallelism_config(self) -> Any:
        return self._accelerator.parallelism_config if self._accelerator is not None else None

    # What lowbit does not run: Megatron-LM (refused by name where it is asked for), the old
    # TorchTensorParallelPlugin (ParallelismConfig(tp_size=...) instead), XLA's bf16 downcast.
    megatron_lm_plugin = torch_tp_plugin = None
    downcast_bfloat = False

    @property
    def deepspeed_plugins(self) -> dict[str, Any] | None:
        """The DeepSpeed plugins by name: lowbit runs one per Accelerator, named "default"."""
        return {"default": self.deepspeed_plugin} if self.deepspeed_plugin is not None else None

    def get_deepspeed_plugin(self, name: str) -> Any:
        plugins = self.deepspeed_plugins or {}
        if name not in plugins:
            raise KeyError(
                f"No DeepSpeed plugin named {name!r}: "
                + ("this Accelerator's one is 'default'." if plugins else "this Accelerator runs no DeepSpeed.")
                + " lowbit runs one DeepSpeed plugin per Accelerator (Accelerate's several plugins, one per model, "
                "are not offered: give each model its own Accelerator)."
            )
        return plugins[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Activate the plugin ``name``: the one plugin is always active; another name is an error."""
        self.get_deepspeed_plugin("default" if name is None else name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_owner", "_partial"):
            raise AttributeError(name)
        try:
            return getattr(self._partial, name)
        except AttributeError:  # named as this object's, not the process state's it reads through to
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    def __repr__(self) -> str:
        return f"{self._partial!r}Mixed precision type: {self.mixed_precision}\n"


# The Accelerator made last in this process: what a GradientState() made apart from one follows.
_LATEST_ACCELERATOR: dict[str, Any] = {"ref": _no_owner}


class GradientState:
    """Accelerate's ``GradientState``, answered from the runtime's sync facts
    (:mod:`lowbit.runtime.training.gradient_sync`): whether this Accelerator's micro-batch syncs
    gradients (``sync``, the Accelerator's own), and whether the dataloader being iterated (in
    this process: loaders nest in the process, whichever Accelerator prepared them) just yielded
    its last batch. One made apart (``GradientState()``, as scripts written for Accelerate's shared
    one do) follows the Accelerator made last."""

    def __init__(self, accelerator: Any = None, gradient_accumulation_plugin: Any = None) -> None:
        self._owner = _weak(accelerator)
        self._follows_latest = accelerator is None
        self.sync = GradientSync()
        plugin = getattr(accelerator, "gradient_accumulation_plugin", None)
        # Read once, as Accelerate keeps them (transformers' Trainer reads them every micro-batch).
        self._plugin_kwargs = plugin.to_kwargs() if plugin is not None else {}
        if accelerator is not None:
            _LATEST_ACCELERATOR["ref"] = self._owner

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch reduces gradients and lets the optimizers step."""
        followed = self._followed()
        return (followed.sync if followed is not None else self.sync).sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        followed = self._followed()
        (followed.sync if followed is not None else self.sync).sync_gradients = value

    def _followed(self) -> "GradientState | None":
        """The state of the Accelerator made last, for a state made apart from one."""
        if not self._follows_latest:
            return None
        latest = _LATEST_ACCELERATOR["ref"]()
        return latest.gradient_state if latest is not None else None

    @property
    def active_dataloader(self) -> Any:
        """The dataloader being iterated (the innermost, when loops nest), or None."""
        return active_loader()

    @property
    def in_dataloader(self) -> bool:
        return bool(ITERATED_LOADERS)

    @property
    def dataloader_references(self) -> list[Any]:
        return [None, *ITERATED_LOADERS]

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active dataloader just yielded its last batch."""
        return bool(getattr(self.active_dataloader, "end_of_dataloader", False))

    @property
    def remainder(self) -> int:
        """How many samples of the active dataloader's last batch are not padding (-1: unknown, or none)."""
        return getattr(self.active_dataloader, "remainder", -1)

    def dataloader_started(self, dataloader: Any) -> None:
        """``dataloader`` is iterated from now on (innermost)."""
        loader_started(dataloader)

    def dataloader_ended(self, dataloader: Any) -> None:
        """``dataloader``'s iteration ended (done, or left)."""
        loader_ended(dataloader)

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a pickled prepared optimizer) keeps the flags, not the Accelerator: it stands alone.
        return {**self.__dict__, "_owner": _no_owner}

    @property
    def _accelerator(self) -> Any:
        owner = self._owner()
        return owner if owner is not None or not self._follows_latest else _LATEST_ACCELERATOR["ref"]()

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Set ``sync_gradients`` (Accelerate's setter; transformers' Trainer accumulates itself and
        calls it each micro-batch)."""
        self.sync_gradients = sync_gradients

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The gradient accumulation plugin's settings changed from their defaults, as Accelerate
        keeps them (``{"num_steps": 1}`` under Trainer, which reads ``sync_each_batch`` here)."""
        followed = self._followed()
        return followed.plugin_kwargs if followed is not None else self._plugin_kwargs

    @property
    def num_steps(self) -> int:
        return self._accelerator.gradient_accumulation_steps if self._accelerator is not None else 1

    @property
    def adjust_scheduler(self) -> bool:
        return bool(self.plugin_kwargs.get("adjust_scheduler", False))

    @property
    def sync_with_dataloader(self) -> bool:
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def initialized(self) -> bool:
        return True  # made with its Accelerator (or following the latest one)

    @property
    def is_xla_gradients_synced(self) -> bool:
        return False  # no XLA devices in lowbit

    @staticmethod
    def _reset_state() -> None:
        """Nothing is global in lowbit; kept for scripts that call it."""
