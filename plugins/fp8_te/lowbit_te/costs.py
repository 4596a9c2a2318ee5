"""What Transformer Engine's recipes cost a Linear beyond bf16, for lowbit's FP8 payoff prediction.

TE casts each tensor in one fused kernel that writes the row-wise and the column-wise
(transposed) copies together (``transformer_engine/common/transpose/cast_transpose.cu`` and the
MX/NVFP4 quantizers of TE 2.x): read bf16 (2 bytes), write both copies. Delayed scaling takes
its scale from the amax history, so the amax is reduced inside that kernel; current scaling
reads the tensor once more for its amax first. TE runs eager with these kernels already fused,
so torch.compile saves nothing here (``fusable_read=False``).
"""

from __future__ import annotations

from lowbit.kernel.plugin_api import RecipeCost

ROLES = ("input", "weight", "grad_output")
# FBGEMM pytorch/FBGEMM#2546 (H100, 8192^3): the 128x128-block-scaled FP8 GEMM at 870 TFLOP/s
# beside the rowwise one at 1126, taken as the share of a per-tensor one.
_BLOCK_GEMM = 0.77

RECIPE_COSTS = {
    "delayed": RecipeCost(
        "fp8", {role: (4.0,) for role in ROLES}, "TE cast-transpose, amax from the history", fusable_read=False
    ),
    "current": RecipeCost(
        "fp8", {role: (2.0, 4.0) for role in ROLES}, "TE amax pass, then cast-transpose", fusable_read=False
    ),
    "block": RecipeCost(
        "fp8",
        {role: (4.0,) for role in ROLES},
        "TE cast-transpose; GEMM share: FBGEMM#2546",
        gemm_share=_BLOCK_GEMM,
        block=128,
        fusable_read=False,
    ),
    # both MX copies (1 byte per value + 1 per 32) from one read
    "mxfp8": RecipeCost(
        "fp8", {role: (2.0 + 2 * (1 + 1 / 32),) for role in ROLES}, "TE MXFP8 quantizer", block=32, fusable_read=False
    ),
    # both NVFP4 copies (half a byte per value + 1 per 16) from one read; the GEMMs at the FP4 peak
    "nvfp4": RecipeCost(
        "fp4",
        {role: (2.0 + 2 * (0.5 + 1 / 16),) for role in ROLES},
        "TE NVFP4 quantizer",
        value_bytes=0.5,
        block=16,
        fusable_read=False,
    ),
}
