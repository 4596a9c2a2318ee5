"""Accelerate's ``accelerate.utils.other`` path (and ``get_grad_scaler``, ``tqdm``)."""

from __future__ import annotations

import logging
import os
import platform
import re
from typing import Any

from lowbit.compat.paths import public_path

__all__ = [
    "check_os_kernel",
    "extract_model_from_parallel",
    "get_active_deepspeed_plugin",
    "get_grad_scaler",
    "get_model_tp_size",
    "is_peft_model",
    "load",
    "save",
    "tqdm",
    "wait_for_everyone",
    "write_basic_config",
]

logger = logging.getLogger(public_path(__name__))
# Older Linux kernels can hang multi-process jobs (Accelerate warns below this one too).
MIN_LINUX_KERNEL = "5.5.0"


def extract_model_from_parallel(
    model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> Any:
    """The model inside DDP / DataParallel / DeepSpeed wrappers (compiled when it was compiled
    itself and ``keep_torch_compile``). ``recursive``: accepted; lowbit's wrappers are all at the top."""
    from lowbit.runtime.training.preparation import unwrap

    return unwrap(model, keep_fp32_wrapper, keep_torch_compile)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (LoRA and kin), without importing peft when it is not loaded."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, (peft.PeftModel, peft.PeftMixedModel))


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> Any:
    import torch

    return torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu", **kwargs)


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown on the local main process only (unless main_process_only=False)."""
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)


def get_model_tp_size(model: Any) -> int | None:
    """The tensor-parallel degree transformers loaded ``model`` with: ``model.tp_size`` (transformers
    < 5), else its config's ``distributed_config`` (an object or, read back from JSON, a dict); None
    when the model was not loaded tensor-parallel."""
    if getattr(model, "tp_size", None) is not None:
        return model.tp_size
    layout = getattr(getattr(model, "config", None), "distributed_config", None)
    return layout.get("tp_size") if isinstance(layout, dict) else getattr(layout, "tp_size", None)


def check_os_kernel() -> None:
    """Warn (through logging) on Linux kernels older than MIN_LINUX_KERNEL."""
    from packaging.version import Version

    info = platform.uname()
    found = re.search(r"\d+\.\d+\.\d+", info.release) if info.system == "Linux" else None
    if found and Version(found.group()) < Version(MIN_LINUX_KERNEL):
        logger.warning(
            f"This Linux kernel is {found.group()}; multi-process jobs can hang on kernels older than "
            f"{MIN_LINUX_KERNEL}. Upgrade the kernel if processes stop responding."
        )


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """``torch.save`` (or safetensors' ``save_file`` with ``safe_serialization``) on the main process
    only, or on each machine's local main process with ``save_on_each_node``. A state dict saved as
    safetensors keeps one of the tensors that share memory (tied weights), saying which it dropped."""
    import torch

    from lowbit.compat.state import PartialState

    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if not safe_serialization:
        torch.save(obj, f)
        return
    from safetensors.torch import save_file

    from lowbit.runtime.checkpoint.model_files import split_shared_tensors

    kept, dropped = split_shared_tensors(obj)
    if dropped:
        logger.warning(
            f"Removed shared tensor {', '.join(dropped)} while saving to {f}: safetensors stores a storage "
            "once; tie the weights again after loading."
        )
    save_file(kept, f, metadata={"format": "pt"})


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` that runs no pickled code unless asked (``weights_only=True`` by default)."""
    import torch

    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)


def wait_for_everyone() -> None:
    """A barrier over the job's processes (nothing to wait for in one)."""
    from lowbit.runtime.process_group import wait_for_everyone as barrier

    barrier()


def get_active_deepspeed_plugin(state: Any) -> Any:
    """The DeepSpeedPlugin of ``state`` (an Accelerator's ``accelerator.state``)."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError(
            "No DeepSpeedPlugin on this state: give Accelerator(deepspeed_plugin=...) or use distributed_type "
            "deepspeed (lowbit-deepspeed)."
        )
    return plugin


def write_basic_config(mixed_precision: str = "no", save_location: str | os.PathLike | None = None) -> Any:
    """Write a config file for this machine (every GPU, or the CPU) with ``mixed_precision``, unless
    one exists there; returns its path, or False when a file was already there (left as it is)."""
    import torch

    from lowbit.run.settings import LowbitConfig, default_config_path, write_config_file

    path = default_config_path() if save_location is None else save_location
    if os.path.exists(path):
        print(f"lowbit: a config file exists at {path}; left as it is (`lowbit config` rewrites it).")
        return False
    gpus = torch.cuda.device_count()
    config = LowbitConfig(
        mixed_precision=mixed_precision,
        num_processes=max(gpus, 1),
        use_cpu=gpus == 0,
        distributed_type="MULTI_GPU" if gpus > 1 else "NO",
    )
    return write_config_file(config, path)
