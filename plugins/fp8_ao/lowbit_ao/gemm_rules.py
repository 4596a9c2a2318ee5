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


# Operand layouts already passed by torch's meta check (a step repeats the same few).
_PASSED: set[tuple] = set()


def _meta_like(tensor: Any) -> Any:
    import torch

    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def check_like_cuda(a: Any, b: Any, scale_a: Any, scale_b: Any, out_dtype: Any, gemm: str) -> None:
    """Raise :class:`FP8GemmShapeError` when CUDA's ``torch._scaled_mm`` would refuse these operands,
    by asking torch's own meta check of ``_scaled_mm`` (which applies CUDA's rules to meta tensors:
    row-major ``a``, column-major ``b``, dims multiples of 16, the scale shapes of each scaling).
    Each distinct layout is checked once per process; under ``torch.compile`` nothing is checked
    (the eager run before it was)."""
    import torch

    if torch.compiler.is_compiling():
        return
    key = tuple((tuple(t.shape), t.stride(), t.dtype) for t in (a, b, scale_a, scale_b)) + (out_dtype,)
    if key in _PASSED:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes():  # a user's dispatch mode (a GEMM counter) sees the GEMM, not its check
            torch._scaled_mm(
                _meta_like(a), _meta_like(b), _meta_like(scale_a), _meta_like(scale_b), out_dtype=out_dtype
            )
    except RuntimeError as exc:
        raise FP8GemmShapeError(
            f"lowbit-ao: this FP8 {gemm} GEMM, {tuple(a.shape)} @ {tuple(b.shape)} (strides {a.stride()} and "
            f"{b.stride()}, scales {tuple(scale_a.shape)} and {tuple(scale_b.shape)}), would fail on a CUDA GPU: "
            f"torch's own check of _scaled_mm says: {exc}. Emulation here would accept it, so lowbit refuses it as "
            "the GPU would. Keep layers whose dims are not multiples of 16 out of FP8."
        ) from None
    _PASSED.add(key)
