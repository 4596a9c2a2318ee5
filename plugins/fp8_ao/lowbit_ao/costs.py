"""What lowbit-ao's recipes cost a Linear beyond bf16, for lowbit's FP8 payoff prediction.

The cast accounting is torchao's own roofline (``benchmarks/float8/utils/roofline_utils.py``,
``get_tensor_memory_traffic_ovhd_s``), in bytes per element read plus written for each kernel,
bf16 in: a tensorwise cast is an amax pass and one kernel writing the row- and column-major FP8
copies; a rowwise cast writes the row-major copy and a transposed bf16 copy, then casts that; MX
casts each layout in its own kernel. Only the recipes lowbit-ao runs natively on a GPU have a
cost: its NVFP4 is emulated everywhere (never faster than bf16).
"""

from __future__ import annotations

from lowbit.kernel.plugin_api import RecipeCost

_TENSORWISE = (2.0, 4.0)  # amax pass (read); cast writing both FP8 layouts
_ROWWISE = (5.0, 3.0)  # cast + transposed bf16 copy; cast of the copy
# pytorch/pytorch#147971: torch's rowwise-scaled FP8 GEMM runs at 90-100 % of the tensorwise
# (cuBLAS) one for most shapes on an H100; 0.9 taken.
_ROWWISE_GEMM = 0.9

RECIPE_COSTS = {
    "tensorwise": RecipeCost(
        "fp8",
        {"input": _TENSORWISE, "weight": (2.0, 3.0, 3.0), "grad_output": _TENSORWISE},
        "torchao roofline_utils.py (tensorwise)",
    ),
    "rowwise": RecipeCost(
        "fp8",
        {"input": _ROWWISE, "weight": (3.0, 4.0, 3.0), "grad_output": _ROWWISE},
        "torchao roofline_utils.py (rowwise); GEMM share: pytorch#147971",
        gemm_share=_ROWWISE_GEMM,
    ),
    "rowwise_with_gw_hp": RecipeCost(
        "fp8",
        {"input": (3.0,), "weight": (3.0, 3.0), "grad_output": (3.0,)},
        "torchao roofline_utils.py (rowwise_with_gw_hp); GEMM share: pytorch#147971",
        low_precision=(True, True, False),
        gemm_share=_ROWWISE_GEMM,
    ),
    "mxfp8": RecipeCost(
        "fp8",
        {role: (3.0, 3.0) for role in ("input", "weight", "grad_output")},
        "torchao roofline_utils.py (mxfp8_cublas)",
        block=32,
    ),
}
