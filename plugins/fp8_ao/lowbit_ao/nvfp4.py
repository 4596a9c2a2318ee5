"""NVFP4 training, emulated: every GEMM of a Linear takes NVFP4-quantized operands (the values a
Blackwell GPU would multiply), multiplied after dequantization in fp32.

The format (NVIDIA's NVFP4 description; TE 2.20.2 ``common/recipe/__init__.py``,
``NVFP4BlockScaling``): E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), one E4M3
scale per 16 consecutive elements, and one fp32 scale per tensor chosen so the largest block
scale is E4M3's largest value (448): ``global = 448 * 6 / amax``. A block's scale is
``e4m3(amax_block / 6 * global)``; its elements are ``x * global / scale`` rounded to E2M1
(nearest, ties to even, or stochastically) and saturated at 6.

NVIDIA's training recipe, which the options follow (all on by default): weights are scaled in
16x16 tiles (``nvfp4_2d_weight_scaling``), so the forward and the input-gradient GEMM see the same
quantized weight; gradients are rounded stochastically (``nvfp4_stochastic_rounding``); the
operands of the weight-gradient GEMM, whose inner dimension is the tokens, pass through a random
16x16 Hadamard transform first (``nvfp4_random_hadamard``), which spreads outliers over the block
and cancels in the product (H is orthogonal).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# The non-negative E2M1 values, and the midpoints between neighbours with where a tie goes:
# to the value with an even mantissa (0, 1, 2, 4 have mantissa bit 0; 0.5, 1.5, 3, 6 have 1).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


@dataclass
class NVFP4Settings:
    """How one Linear's GEMMs quantize (the recipe options)."""

    weight_2d: bool = True
    stochastic_rounding: bool = True
    random_hadamard: bool = True


@functools.lru_cache(maxsize=None)
def _grid(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The E2M1 values on ``device``, made once (every GEMM rounds onto them, six times a step)."""
    return torch.tensor(E2M1_GRID, dtype=dtype, device=device)


def round_to_e2m1(x: torch.Tensor, stochastic: bool = False) -> torch.Tensor:
    """``x`` (already scaled into E2M1's range) rounded onto the E2M1 grid, saturating at +-6."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    grid = _grid(x.dtype, x.device)
    if stochastic:
        below = torch.bucketize(magnitude, grid, right=True) - 1  # index of the grid value <= magnitude
        below = below.clamp(max=len(E2M1_GRID) - 2)
        low, high = grid[below], grid[below + 1]
        up = torch.rand_like(magnitude) < (magnitude - low) / (high - low)
        rounded = torch.where(up, high, low)
    else:
        index = torch.zeros_like(magnitude, dtype=torch.long)
        for midpoint, tie_up in zip(_MIDPOINTS, _TIE_ROUNDS_UP):
            index += (magnitude >= midpoint) if tie_up else (magnitude > midpoint)
        rounded = grid[index]
    return torch.copysign(rounded, x)


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor fp32 encode scale: the largest block scale lands on E4M3's largest value."""
    amax = amax.float()
    return torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))


def _blocks(x: torch.Tensor, two_d: bool) -> torch.Tensor:
    """``x`` (rows, cols) as blocks: (rows, cols/16, 16), or 16x16 tiles (rows/16, cols/16, 256)."""
    rows, cols = x.shape
    if not two_d:
        return x.reshape(rows, cols // BLOCK, BLOCK)
    return (
        x.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        .permute(0, 2, 1, 3)
        .reshape(rows // BLOCK, cols // BLOCK, BLOCK * BLOCK)
    )


def _unblocks(blocks: torch.Tensor, shape: torch.Size, two_d: bool) -> torch.Tensor:
    rows, cols = shape
    if not two_d:
        return blocks.reshape(rows, cols)
    return blocks.reshape(rows // BLOCK, cols // BLOCK, BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(rows, cols)


def quantize(
    x: torch.Tensor, two_d: bool = False, stochastic: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-quantize a 2-D ``x`` along its last dim (or in 16x16 tiles): returns the E2M1 values
    (as floats on the grid), the E4M3 block scales and the fp32 global scale."""
    if x.dim() != 2 or x.shape[-1] % BLOCK or (two_d and x.shape[0] % BLOCK):
        raise ValueError(
            f"NVFP4 quantizes 2-D tensors whose dims are multiples of {BLOCK} (its block); got {list(x.shape)}"
        )
    x = x.float()
    scale = global_scale(x.abs().amax())
    blocks = _blocks(x, two_d)
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    wanted = block_amax / E2M1_MAX * scale
    block_scale = wanted.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    decode = block_scale.float() / scale  # what one E2M1 unit is worth in the block
    values = round_to_e2m1(torch.where(decode > 0, blocks / decode, torch.zeros_like(blocks)), stochastic)
    return _unblocks(values, x.shape, two_d), block_scale.squeeze(-1), scale


def dequantize(
    values: torch.Tensor, block_scale: torch.Tensor, scale: torch.Tensor, two_d: bool = False
) -> torch.Tensor:
    """The fp32 tensor that ``quantize``'s output stands for."""
    decode = block_scale.float().unsqueeze(-1) / scale
    return _unblocks(_blocks(values, two_d) * decode, values.shape, two_d)


def fake_quantize(x: torch.Tensor, two_d: bool = False, stochastic: bool = False) -> torch.Tensor:
    """``x`` as NVFP4 represents it (quantized, then dequantized), in fp32."""
    return dequantize(*quantize(x, two_d, stochastic), two_d=two_d)


def hadamard_16(signs: torch.Tensor) -> torch.Tensor:
    """A random 16x16 Hadamard transform: Sylvester's H16 with a random sign per row, / 4 (orthogonal)."""
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (signs.float().unsqueeze(1) * h) / BLOCK**0.5


def random_signs(seed: int) -> torch.Tensor:
    """16 fixed random signs (one Linear's transform), from a seed so every rank and a resumed run agree."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (BLOCK,), generator=generator) * 2 - 1


def _along_tokens(t: torch.Tensor, transform: torch.Tensor | None) -> torch.Tensor:
    """(tokens, features) -> (features, tokens), with 16-token blocks rotated by ``transform``."""
    t = t.t()
    if transform is None:
        return t
    features, tokens = t.shape
    return (t.reshape(features, tokens // BLOCK, BLOCK) @ transform).reshape(features, tokens)


class NVFP4Linear(torch.autograd.Function):
    """``x @ weight.T`` with all three GEMMs on NVFP4 operands (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, settings: NVFP4Settings, transform):
        x2 = x.reshape(-1, x.shape[-1]).float()
        w = weight.float()
        weight_q = fake_quantize(w, two_d=settings.weight_2d)
        out = fake_quantize(x2) @ weight_q.t()
        ctx.save_for_backward(x2, w, weight_q if settings.weight_2d else None)
        ctx.settings, ctx.transform, ctx.shape, ctx.dtypes = settings, transform, x.shape, (x.dtype, weight.dtype)
        return out.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x2, w, weight_q = ctx.saved_tensors
        settings = ctx.settings
        g = grad_out.reshape(-1, grad_out.shape[-1]).float()
        sr = settings.stochastic_rounding
        # input gradient: inner dim out_features. A 2-D-scaled weight is the same quantized tensor
        # whichever way it is read; a 1-D one is quantized again along out_features.
        weight_t = weight_q if weight_q is not None else fake_quantize(w.t().contiguous()).t()
        grad_x = fake_quantize(g, stochastic=sr) @ weight_t
        # weight gradient: inner dim tokens, operands (optionally) Hadamard-rotated in 16-token blocks.
        transform = ctx.transform if settings.random_hadamard else None
        g_t = fake_quantize(_along_tokens(g, transform).contiguous(), stochastic=sr)
        x_t = fake_quantize(_along_tokens(x2, transform).contiguous())
        grad_w = g_t @ x_t.t()
        x_dtype, w_dtype = ctx.dtypes
        return grad_x.reshape(ctx.shape).to(x_dtype), grad_w.to(w_dtype), None, None


def nvfp4_linear(
    x: torch.Tensor, weight: torch.Tensor, settings: NVFP4Settings, transform: torch.Tensor | None
) -> torch.Tensor:
    return NVFP4Linear.apply(x, weight, settings, transform)
