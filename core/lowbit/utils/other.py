"""Accelerate's ``accelerate.utils.other`` path (and ``get_grad_scaler``, ``tqdm``)."""
from __future__ import annotations

import os
from typing import Any

__all__ = ["extract_model_from_parallel", "get_grad_scaler", "tqdm"]


def extract_model_from_parallel(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> Any:
    """The model inside DDP / DataParallel / DeepSpeed wrappers (compiled when it was compiled
    itself and ``keep_torch_compile``). ``recursive``: accepted; lowbit's wrappers are all at the top."""
    from lowbit.training.preparation import unwrap

    return unwrap(model, keep_fp32_wrapper, keep_torch_compile)


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> Any:
    import torch

    return torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu", **kwargs)


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown on the local main process only (unless main_process_only=False)."""
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)
