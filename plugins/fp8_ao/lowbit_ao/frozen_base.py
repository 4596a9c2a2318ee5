"""Frozen FP8 bases: a Linear whose weight needs no gradient, stored in FP8 once and run with two GEMMs.

A LoRA step needs, of each frozen base, its output (forward) and the gradient of its input (for the
adapters and the layers below), never the gradient of its weight. torchao's ``Float8Linear``
computes that weight gradient anyway (its backward has no ``needs_input_grad`` check, torchao 0.18
``float8/float8_linear.py``), casts the high-precision weight again each step and saves its input
for the GEMM that is thrown away. :class:`FrozenFP8Linear` instead:

- quantizes the weight once at ``prepare()`` (e4m3, per tensor or per 128x128 block) and keeps only
  the FP8 data and its scales (1 byte a weight; the high-precision copy is no longer referenced);
- runs the forward as one FP8 GEMM (the input cast to e4m3 per tensor, or per 1x128 block);
- runs the backward as one FP8 GEMM for the input gradient (the output gradient cast to e5m2 per
  tensor, or to e4m3 per 1x128 block), saving no input, computing no weight gradient.

A layer published in FP8 (transformers' ``FP8Linear``: a float8 ``weight`` and its
``weight_scale_inv``, per tensor or per 128x128 block, float32 or UE8M0) is adopted as it is: the
same weight Parameter and the same scale storage, never dequantized and quantized again.

Scales follow ``torch._scaled_mm``'s convention (and the checkpoints'): ``weight_scale_inv`` is
what the FP8 values are multiplied by to give the weight back. Both layouts transpose: the input
gradient's GEMM takes the weight's transpose with the same (transposed) scales, which a per-row
scale would not allow (``rowwise`` recipes get 128x128 blocks for their frozen bases, said in the report).

On a GPU with FP8 GEMMs the GEMMs are ``torch._scaled_mm``; elsewhere they are emulated as it
computes them (the exact FP8 values multiplied, the scales applied per tensor or per block), after
torch's own meta check of ``_scaled_mm`` has passed the same operands (:mod:`lowbit_ao.gemm_rules`),
so a run that is green on a CPU does not fail on a GPU for a shape, layout or scale.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from lowbit_ao.fast_emulation import exact_values, gemm_dtype
from lowbit_ao.gemm_rules import check_like_cuda

BLOCK = 128  # the block of DeepSeek-style checkpoints (and of torch._scaled_mm's blockwise scaling)
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclasses.dataclass(frozen=True)
class FrozenGemms:
    """How a frozen base's GEMMs run: ``torch._scaled_mm`` (``native``), or emulated with the fp8
    values multiplied in ``compute_dtype`` (bf16 where bf16 GEMMs are fast, else fp32)."""

    native: bool
    compute_dtype: torch.dtype = torch.float32


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax().float().clamp_min(1e-12)


def _pad_to_block(x: torch.Tensor, dim: int) -> torch.Tensor:
    extra = (-x.shape[dim]) % BLOCK
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return nn.functional.pad(x, pad)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``dtype`` with one scale: (data, scale_inv), ``data * scale_inv`` approximating ``x``."""
    top = torch.finfo(dtype).max
    scale_inv = _amax(x) / top
    data = (x.float() / scale_inv).clamp(-top, top).to(dtype)
    return data, scale_inv


def quantize_rows_by_block(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D ``x`` (M, K) in ``dtype`` with one scale per 1x128 block of each row: scale_inv (M, ceil(K/128))."""
    rows, cols = x.shape
    top = torch.finfo(dtype).max
    blocks = _pad_to_block(x.float(), 1).unflatten(1, (-1, BLOCK))
    scale_inv = blocks.abs().amax(dim=2).clamp_min(1e-12) / top
    data = (blocks / scale_inv.unsqueeze(2)).clamp(-top, top).flatten(1)[:, :cols].to(dtype)
    return data.contiguous(), scale_inv


def quantize_weight_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (N, K) in e4m3 with one scale per 128x128 block: scale_inv (ceil(N/128), ceil(K/128)),
    each block's amax / 448 unless given."""
    rows, cols = weight.shape
    top = torch.finfo(E4M3).max
    padded = _pad_to_block(_pad_to_block(weight.detach().float(), 0), 1)
    blocks = padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))  # (nb, 128, kb, 128)
    if scale_inv is None:
        scale_inv = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / top
    data = (blocks / scale_inv[:, None, :, None]).clamp(-top, top).flatten(2).flatten(0, 1)
    return data[:rows, :cols].to(E4M3).contiguous(), scale_inv


def _expand_blocks(scale_inv: torch.Tensor, rows: int, cols: int, row_block: int) -> torch.Tensor:
    """A (rows, cols) grid of each element's scale, from per-block scales (row_block x 128)."""
    expanded = scale_inv.float().repeat_interleave(row_block, dim=0)[:rows]
    return expanded.repeat_interleave(BLOCK, dim=1)[:, :cols]


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A stored FP8 weight (N, K) back in ``dtype``, per tensor or per 128x128 block."""
    values = exact_values(data, torch.float32)
    if scale_inv.numel() == 1:
        return (values * scale_inv.float()).to(dtype)
    return (values * _expand_blocks(scale_inv, *data.shape, BLOCK)).to(dtype)


def emulated_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """What ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` computes, one GEMM: per
    tensor, the exact fp8 values multiplied in ``compute_dtype`` and both scales applied to the
    output; per block (a: 1x128 along K, b: 128x128), each operand scaled block by block in fp32."""
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        dtype = gemm_dtype(compute_dtype, out_dtype)
        product = torch.mm(exact_values(a, dtype), exact_values(b, dtype)).float()
        return product.mul_(scale_a.float() * scale_b.float()).to(out_dtype)
    rows, inner = a.shape
    columns = b.shape[1]
    a_values = exact_values(a, torch.float32) * _expand_blocks(scale_a, rows, inner, 1)
    b_values = exact_values(b, torch.float32) * _expand_blocks(scale_b, inner, columns, BLOCK)
    return torch.mm(a_values, b_values).to(out_dtype)


def scaled_mm(a, b, scale_a, scale_b, out_dtype: torch.dtype, gemms: FrozenGemms, gemm: str) -> torch.Tensor:
    """One FP8 GEMM of a frozen base: ``torch._scaled_mm`` on FP8 hardware, else its emulation,
    once torch's meta check of ``_scaled_mm`` (CUDA's rules) has passed the same operands."""
    scale_a, scale_b = scale_a.float(), scale_b.float()  # UE8M0 scales are powers of two: exact in fp32
    if gemms.native:
        if scale_a.numel() > 1:  # CUDA's 1x128 blockwise GEMM takes those scales outer-dim-major (stride (1, M)),
            scale_a = scale_a.t().contiguous().t()  # as torch's own tests of _scaled_mm lay them out
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    check_like_cuda(a, b, scale_a, scale_b, out_dtype, gemm)
    return emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype, gemms.compute_dtype)


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _FrozenFP8Matmul(torch.autograd.Function):
    """``x @ dequant(W).T + b`` with two FP8 GEMMs and no weight gradient (nothing saved of ``x``)."""

    @staticmethod
    def forward(ctx, x, weight, scale_inv, bias, gemms: FrozenGemms, static_input_scale):
        out_dtype = _output_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            flat = x.reshape(-1, x.shape[-1])
            blocks = scale_inv.numel() > 1
            if static_input_scale is not None:  # a checkpoint's static activation scale (activation_scheme="static")
                top = torch.finfo(E4M3).max
                x_scale = static_input_scale.float()
                x_data = (flat.float() / x_scale).clamp(-top, top).to(E4M3)
            elif blocks:
                x_data, x_scale = quantize_rows_by_block(flat)
            else:
                x_data, x_scale = quantize_tensorwise(flat)
            w_scale = scale_inv.t() if blocks else scale_inv
            out = scaled_mm(x_data, weight.t(), x_scale, w_scale, out_dtype, gemms, "forward (input @ weight.T)")
            if bias is not None:
                out = out + bias.to(out_dtype)
        ctx.save_for_backward(weight, scale_inv)
        ctx.gemms, ctx.input_shape, ctx.input_dtype = gemms, x.shape, x.dtype
        return out.unflatten(0, x.shape[:-1])

    @staticmethod
    def backward(ctx, grad_output):
        weight, scale_inv = ctx.saved_tensors
        grad_input = grad_bias = None
        flat = grad_output.reshape(-1, grad_output.shape[-1])
        with torch.autocast(grad_output.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                if scale_inv.numel() > 1:  # blocks: the gradient per 1x128 block in e4m3, as DeepSeek-V3 trains
                    g_data, g_scale = quantize_rows_by_block(flat, E4M3)
                else:  # per tensor: the gradient in e5m2, as torchao's tensorwise recipe casts it
                    g_data, g_scale = quantize_tensorwise(flat, E5M2)
                # _scaled_mm takes its second operand column-major: the weight's transpose, laid out once per step
                weight_t = weight.t().contiguous().t()
                grad_input = scaled_mm(
                    g_data, weight_t, g_scale, scale_inv, ctx.input_dtype, ctx.gemms, "input-gradient (grad @ weight)"
                ).reshape(ctx.input_shape)
            if ctx.needs_input_grad[3]:
                grad_bias = flat.sum(0)
        return grad_input, None, None, grad_bias, None, None


class FrozenFP8Linear(nn.Module):
    """A frozen Linear stored in FP8 (``weight``: e4m3, ``weight_scale_inv``: per tensor or per
    128x128 block, the names FP8 checkpoints use), run with two FP8 GEMMs a step. ``published``
    says the FP8 data came from the checkpoint (transformers' ``FP8Linear``), not from lowbit."""

    # What the NaN replay (lowbit.runtime.observe.nonfinite_origin) says ran where a value went non-finite.
    lowbit_gemm_names = {
        "forward": "a frozen FP8 base: its forward FP8 GEMM, input @ weight.T",
        "input-gradient": "a frozen FP8 base: its input-gradient FP8 GEMM, grad @ weight (no weight-gradient GEMM)",
    }

    def __init__(
        self,
        weight: nn.Parameter,
        weight_scale_inv: torch.Tensor,
        bias: nn.Parameter | None,
        gemms: FrozenGemms,
        *,
        published: bool = False,
        original_dtype: torch.dtype = torch.bfloat16,
        activation_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        # Scales are buffers, not parameters: FSDP2 keeps them whole on every rank (it cannot shard a
        # checkpoint's 0-d per-tensor scale), DDP never buckets them, and no optimizer is handed them.
        self.register_buffer("weight_scale_inv", weight_scale_inv.detach())
        self.bias = bias
        self.register_buffer("activation_scale", None if activation_scale is None else activation_scale.detach())
        self.gemms = gemms
        self.published = published
        self.original_dtype = original_dtype  # what the weight was in before lowbit quantized it
        self.conv1d_layout = False  # made from transformers' Conv1D: its plain weight is stored transposed

    @property
    def format(self) -> str:
        return "tensorwise" if self.weight_scale_inv.numel() == 1 else "blocks128"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenFP8Matmul.apply(
            x, self.weight, self.weight_scale_inv, self.bias, self.gemms, self.activation_scale
        )

    def dequantized_weight(self, dtype: torch.dtype | None = None, as_stored_before: bool = False) -> torch.Tensor:
        """The weight (out, in) in high precision (``dtype``, default the one it had before
        quantization), computed out of place: the stored FP8 data and scales are not touched.
        ``as_stored_before``: in the layout the original layer kept it (transformers' Conv1D: (in, out))."""
        plain = dequantize(self.weight.detach(), self.weight_scale_inv.detach(), dtype or self.original_dtype)
        return plain.t().contiguous() if as_stored_before and self.conv1d_layout else plain

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale_inv))

    def extra_repr(self) -> str:
        source = "published" if self.published else "quantized by lowbit"
        how = "torch._scaled_mm" if self.gemms.native else "emulated"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8 {self.format} ({source}), GEMMs {how}"
        )


def frozen(tensor: torch.Tensor | None) -> nn.Parameter | None:
    """A Parameter that needs no gradient (the same object when it already is one)."""
    if tensor is None:
        return None
    if not isinstance(tensor, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=False)
    return tensor.requires_grad_(False) if tensor.requires_grad else tensor


def quantized_base(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, gemms: FrozenGemms) -> FrozenFP8Linear:
    """A frozen base made from a high-precision weight (N, K): quantized once, in ``fmt``."""
    with torch.no_grad():
        data, scale_inv = quantize_weight_blocks(weight) if fmt == "blocks128" else quantize_tensorwise(weight.detach())
    return FrozenFP8Linear(
        nn.Parameter(data, requires_grad=False),
        scale_inv,
        bias,
        gemms,
        original_dtype=weight.dtype,
    )


def published_problem(layer: nn.Module) -> str:
    """Why lowbit cannot run a layer published in FP8 (transformers' FP8Linear), or '' when it can."""
    weight, scale = layer.weight, getattr(layer, "weight_scale_inv", None)
    if weight.dtype != E4M3:
        return f"its weight is {str(weight.dtype).removeprefix('torch.')}; lowbit runs e4m3 (float8_e4m3fn) weights"
    if scale is None:
        return "it has no weight_scale_inv"
    rows, cols = weight.shape
    if scale.numel() == 1:
        return ""
    block = getattr(layer, "block_size", None)
    if block is None or tuple(block) != (BLOCK, BLOCK):
        return f"its scales are in blocks of {block}; lowbit runs per-tensor and 128x128-block scales"
    if tuple(scale.shape) != (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)):
        return (
            f"its weight_scale_inv is {tuple(scale.shape)}, not one scale per 128x128 block of its {rows}x{cols} weight"
        )
    return ""


def published_base(layer: nn.Module, gemms: FrozenGemms) -> FrozenFP8Linear:
    """A layer published in FP8, adopted with its own Parameters (no copy, no new rounding)."""
    return FrozenFP8Linear(
        frozen(layer.weight),
        layer.weight_scale_inv,  # the checkpoint's scales, their storage shared (detached, never copied)
        frozen(layer.bias),
        gemms,
        published=True,
        activation_scale=getattr(layer, "activation_scale", None),
    )
