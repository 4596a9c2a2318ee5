"""Accelerate's ``accelerate.utils.imports`` path: ``is_<library>_available()``."""

from __future__ import annotations

import importlib.util
from typing import Any

# Accelerate's `is_<name>_available()` helpers that training scripts test before importing an
# optional library: name -> the module whose presence answers it.
OPTIONAL_LIBRARIES = {
    "schedulefree": "schedulefree",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "comet_ml": "comet_ml",
    "aim": "aim",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "deepspeed": "deepspeed",
    "transformer_engine": "transformer_engine",
    "msamp": "msamp",
    "torchao": "torchao",
    "datasets": "datasets",
    "transformers": "transformers",
    "rich": "rich",
    "bnb": "bitsandbytes",
    "peft": "peft",
    "timm": "timm",
    "torch_xla": "torch_xla",
    "import_timer": "import_timer",
    "torchdata_stateful_dataloader": "torchdata.stateful_dataloader",
    "pytest": "pytest",
    "hpu": "habana_frameworks",
    "mlu": "torch_mlu",
    "sdaa": "torch_sdaa",
    "musa": "torch_musa",
    "neuron": "torch_neuronx",
}
AVAILABILITY_CHECKS = {f"is_{name}_available": module for name, module in OPTIONAL_LIBRARIES.items()}
__all__ = [
    *AVAILABILITY_CHECKS,
    "is_bf16_available",
    "is_fp8_available",
    "is_cuda_available",
    "is_fp16_available",
    "is_mps_available",
    "is_npu_available",
    "is_xpu_available",
]


def is_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def is_fp16_available() -> bool:
    """Whether fp16 can be trained in here (every device lowbit runs on; slowly on most CPUs)."""
    return True


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether this machine's device computes in bf16 (a CUDA GPU that supports it, or the CPU)."""
    import torch

    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp8_available() -> bool:
    """Whether an FP8 backend library is installed here (MS-AMP, Transformer Engine or torchao), as
    Accelerate answers it; whether lowbit can train in FP8 here is ``lowbit plugins``' answer."""
    return any(importlib.util.find_spec(name) is not None for name in ("msamp", "transformer_engine", "torchao"))


def is_mps_available(min_version: str = "1.12") -> bool:
    import torch

    return torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_npu_available(check_device: bool = False) -> bool:
    """Whether Ascend's torch_npu is installed (lowbit trains on CUDA GPUs and CPUs)."""
    return importlib.util.find_spec("torch_npu") is not None


def is_xpu_available(check_device: bool = False) -> bool:
    import torch

    return hasattr(torch, "xpu") and torch.xpu.is_available()


def availability_check(name: str) -> Any:
    """``is_<library>_available``: a function answering whether the library can be imported."""
    module = AVAILABILITY_CHECKS[name]

    def available() -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a dotted name whose parent package is absent
            return False

    available.__name__ = name
    return available


def __getattr__(name: str) -> Any:
    if name in AVAILABILITY_CHECKS:
        return availability_check(name)
    raise AttributeError(f"module 'lowbit.utils.imports' has no attribute {name!r}")
