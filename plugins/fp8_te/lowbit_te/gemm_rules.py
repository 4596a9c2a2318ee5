"""The shapes Transformer Engine's FP8 GEMMs take, and odd token counts padded to them.

TE refuses an FP8 GEMM whose input has a token count (the product of its leading dims) that is
not a multiple of 8: ``pytorch/utils.py`` ``assert_dim_for_fp8_exec``, called by ``te.Linear``'s
forward whenever FP8 is on (TE 2.9.0 and 2.20.2). MXFP8 scales blocks of 32 elements along both
axes (``constants.py`` ``MXFP8_BLOCK_SCALING_SIZE = 32``, ``tensor/mxfp8_tensor.py``), so there
the count must be a multiple of 32. NVFP4 quantizes only tensors whose leading dims and last dim
are multiples of 16 (``tensor/nvfp4_tensor.py``, ``NVFP4Quantizer.is_quantizable``, 2.20.2).
A batch of 3 sequences of 11 tokens trains on a CPU and crashes on a GPU, so lowbit pads the
flattened tokens with zero rows (``lowbit.kernel.token_padding``).
"""

from __future__ import annotations

from typing import Any

from lowbit.kernel.plugin_api import pad_tokens

# (rows, columns) multiples of every FP8 GEMM operand: the input (tokens, in_features) and the
# weight (out_features, in_features).
FP8_MULTIPLES = (8, 16)
MXFP8_MULTIPLES = (32, 32)
NVFP4_MULTIPLES = (16, 16)
# A TE recipe object's predicate -> the multiples its GEMMs need (common/recipe/__init__.py: Recipe.mxfp8(), .nvfp4()).
_BY_PREDICATE = {"mxfp8": MXFP8_MULTIPLES, "nvfp4": NVFP4_MULTIPLES}


def operand_multiples(options: Any) -> tuple[int, int]:
    """(rows, columns) multiples the chosen recipe's GEMM operands need."""
    recipe = options.te_recipe
    for name, multiples in _BY_PREDICATE.items():
        if (options.recipe == name) if recipe is None else bool(getattr(recipe, name, lambda: False)()):
            return multiples
    return FP8_MULTIPLES


def token_multiple(options: Any) -> int:
    """The token-count multiple the chosen recipe needs."""
    return operand_multiples(options)[0]


def weight_problem(in_features: int, out_features: int, options: Any) -> str:
    """Why TE's FP8 GEMMs cannot take a Linear of these dims, or ''."""
    rows, columns = operand_multiples(options)
    if in_features % columns == 0 and out_features % rows == 0:
        return ""
    return f"dims {in_features}x{out_features}: TE's FP8 GEMMs need in_features % {columns} and out_features % {rows}"


def pad_tokens_for_fp8(module: Any, multiple: int) -> None:
    """Pad the layer's tokens to what TE's GEMMs take (see the module docstring)."""
    pad_tokens(module, multiple)
