"""The shapes Transformer Engine's FP8 GEMMs take, and odd token counts padded to them.

TE refuses an FP8 GEMM whose input has a token count (the product of its leading dims) that is
not a multiple of 8: ``pytorch/utils.py`` ``assert_dim_for_fp8_exec``, called by ``te.Linear``'s
forward whenever FP8 is on (TE 2.9.0 and 2.20.2). MXFP8 scales blocks of 32 elements along both
axes (``constants.py`` ``MXFP8_BLOCK_SCALING_SIZE = 32``, ``tensor/mxfp8_tensor.py``), so there
the count must be a multiple of 32. A batch of 3 sequences of 11 tokens trains on a CPU and
crashes on a GPU. lowbit pads the flattened tokens with zero rows before such a layer and drops
those rows after it: a zero row adds nothing to the weight gradient, the bias gradient or any
amax, so the results are those of the unpadded batch.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# (rows, columns) multiples of every FP8 GEMM operand: the input (tokens, in_features) and the
# weight (out_features, in_features).
FP8_MULTIPLES = (8, 16)
MXFP8_MULTIPLES = (32, 32)


def _is_mxfp8(options: Any) -> bool:
    recipe = options.te_recipe
    return options.scaling == "mxfp8" if recipe is None else bool(getattr(recipe, "mxfp8", lambda: False)())


def operand_multiples(options: Any) -> tuple[int, int]:
    """(rows, columns) multiples the chosen recipe's GEMM operands need."""
    return MXFP8_MULTIPLES if _is_mxfp8(options) else FP8_MULTIPLES


def token_multiple(options: Any) -> int:
    """The token-count multiple the chosen recipe needs."""
    return operand_multiples(options)[0]


def weight_problem(in_features: int, out_features: int, options: Any) -> str:
    """Why TE's FP8 GEMMs cannot take a Linear of these dims, or ''."""
    rows, columns = operand_multiples(options)
    if in_features % columns == 0 and out_features % rows == 0:
        return ""
    return f"dims {in_features}x{out_features}: TE's FP8 GEMMs need in_features % {columns} and out_features % {rows}"


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


def pad_tokens_for_fp8(module: nn.Module, multiple: int) -> None:
    """Pad ``module``'s input tokens to ``multiple`` and unpad its output (hooks; idempotent).
    The shapes wait on a stack, so a re-run forward (activation checkpointing) pairs up too."""
    if getattr(module, "_lowbit_token_multiple", None) is not None:
        return
    module._lowbit_token_multiple = multiple
    module._lowbit_unpadded_shapes = []
    module.register_forward_pre_hook(_pad)
    module.register_forward_hook(_unpad)
