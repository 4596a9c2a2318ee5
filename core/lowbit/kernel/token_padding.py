"""Odd token counts padded with zero rows around a layer, for backends whose low-precision GEMMs
need the token count (a GEMM dimension, the inner one of the weight gradient) to be a multiple.

A zero row adds nothing to the weight gradient, the bias gradient, any amax or any block's
scale, and its output row is dropped after the layer, so the results are those of the unpadded
batch. Used by lowbit-te (TE refuses odd counts) and lowbit-ao's block formats (MXFP8 and NVFP4
scale the tokens in blocks of 32 and 16 in the weight-gradient GEMM).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def _pad(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    x = args[0] if args else None
    pending = module._lowbit_unpadded_shapes
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        pending.append(None)
        return None
    tokens = math.prod(x.shape[:-1])
    missing = (-tokens) % module._lowbit_token_multiple
    if not missing:
        pending.append(None)
        return None
    pending.append(x.shape[:-1])
    return (F.pad(x.reshape(tokens, x.shape[-1]), (0, 0, 0, missing)), *args[1:])


def _unpad(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    shape = module._lowbit_unpadded_shapes.pop()
    if shape is None:
        return None
    return output[: math.prod(shape)].reshape(*shape, output.shape[-1])


def pad_tokens(module: nn.Module, multiple: int) -> None:
    """Pad ``module``'s input tokens to ``multiple`` and unpad its output (hooks; idempotent).
    The shapes wait on a stack, so a re-run forward (activation checkpointing) pairs up too."""
    if getattr(module, "_lowbit_token_multiple", None) is not None:
        return
    module._lowbit_token_multiple = multiple
    module._lowbit_unpadded_shapes = []
    module.register_forward_pre_hook(_pad)
    module.register_forward_hook(_unpad)
