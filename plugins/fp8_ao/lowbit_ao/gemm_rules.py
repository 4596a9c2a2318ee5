"""The shape rules a CUDA GPU's FP8 GEMM enforces, checked wherever lowbit runs FP8 GEMMs another way.

On an sm_89+ GPU torchao's Float8 GEMMs go to ``torch._scaled_mm``, whose CUDA kernel refuses
operands whose inner dimension, or the second operand's columns, are not multiples of 16
(``aten/src/ATen/native/cuda/Blas.cpp``, ``_scaled_mm_out_cuda``: ``mat1.size(1) % 16`` and
``mat2.size(0) % 16 && mat2.size(1) % 16``; unchanged from torch 2.4 to 2.13). The emulations
and torch's CPU kernel accept any shape, so without this check a run that is green on a CPU
crashes on its first GPU backward: the weight-gradient GEMM puts the token count (batch x
sequence) on the inner axis. lowbit checks every GEMM of a converted layer against the CUDA
rule, after the padding torchao applies with ``pad_inner_dim``, and raises what a GPU would.
"""

from __future__ import annotations

from typing import Any

SCALED_MM_MULTIPLE = 16

# torchao's GemmInputRole values of (a, b) -> which GEMM of a Linear layer this is.
_GEMMS = {
    ("input", "weight"): "forward (input @ weight.T)",
    ("grad_output", "weight"): "input-gradient (grad_output @ weight)",
    ("grad_output", "input"): "weight-gradient (grad_output.T @ input)",
}


class FP8GemmShapeError(RuntimeError):
    """An FP8 GEMM whose shapes a CUDA GPU's ``torch._scaled_mm`` refuses."""


def padded(size: int, pad: bool) -> int:
    """The size torchao hands to ``torch._scaled_mm`` for an inner dimension (``pad_inner_dim``)."""
    return size + (-size) % SCALED_MM_MULTIPLE if pad else size


def _role(tensor: Any) -> str:
    role = getattr(tensor, "_gemm_input_role", None)
    return str(getattr(role, "value", role) or "?").lower()


def check_scaled_mm_shapes(a: Any, b: Any, pad_inner_dim: bool) -> None:
    """Raise :class:`FP8GemmShapeError` when ``a @ b`` (two torchao Float8 tensors, 2-D) is a GEMM
    CUDA's ``torch._scaled_mm`` would refuse after torchao's own padding."""
    rows, inner = a._data.shape[-2], a._data.shape[-1]
    columns = b._data.shape[-1]
    inner_sent = padded(inner, pad_inner_dim)
    if inner_sent % SCALED_MM_MULTIPLE == 0 and columns % SCALED_MM_MULTIPLE == 0:
        return
    gemm = _GEMMS.get((_role(a), _role(b)), f"{_role(a)} @ {_role(b)}")
    problems = []
    if inner_sent % SCALED_MM_MULTIPLE:
        what = "the token count (batch x sequence)" if gemm.startswith("weight-gradient") else "the inner dimension"
        problems.append(
            f"its inner dimension {inner} ({what}) is not a multiple of {SCALED_MM_MULTIPLE} and "
            "padding is off (pad_inner_dim=False)"
        )
    if columns % SCALED_MM_MULTIPLE:
        problems.append(
            f"its output has {columns} columns, not a multiple of {SCALED_MM_MULTIPLE} (a layer with such "
            "dims was converted: check module_filter_func)"
        )
    fixes = (
        "Turn padding back on (AORecipeKwargs(pad_inner_dim=True), lowbit's default; a config=Float8LinearConfig(...) "
        "needs pad_inner_dim=True itself) or make batch x sequence a multiple of 16."
        if inner_sent % SCALED_MM_MULTIPLE
        else "Keep layers whose dims are not multiples of 16 out of FP8."
    )
    raise FP8GemmShapeError(
        f"lowbit-ao: this FP8 {gemm} GEMM, ({rows}x{inner}) @ ({inner}x{columns}), would fail on a CUDA GPU, whose "
        f"torch._scaled_mm needs every inner dimension and the output columns to be multiples of {SCALED_MM_MULTIPLE}: "
        f"{'; '.join(problems)}. Emulation here would accept it, so lowbit refuses it as the GPU would. {fixes}"
    )
