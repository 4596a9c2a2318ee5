"""Block-scaled recipes in lowbit-ao: MXFP8 through torchao's prototype ``mx_mm`` and NVFP4 through
lowbit-ao's emulation (``nvfp4.py``).

A converted layer keeps its class's parameters, names and layout (its class becomes a subclass
whose forward runs the block-scaled GEMMs), so the optimizer, tied weights, DDP, FSDP2 and
``save_model`` see the same Parameters as before. Block formats scale the GEMM's inner dimension
in blocks (32 elements for MXFP8, 16 for NVFP4), and every GEMM of a Linear has a different inner
dimension: in_features (forward), out_features (input gradient) and the tokens (weight
gradient). So both weight dims must be multiples of the block (else the layer stays in high
precision, with the reason in the FP8 report), and the tokens are padded with zero rows to one
(``lowbit.kernel.token_padding``): what torchao's MXFP8 casts assert on every device
(``MXTensor.to_mx``: "the last dimension ... must be divisible by block_size") and what TE's
NVFP4 quantizer requires (tensor/nvfp4_tensor.py ``is_quantizable``, 2.20.2).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.kernel.plugin_api import PrepareContext, fp4_layers_kept_bf16, pad_tokens

from lowbit_ao.conv1d import conv1d_class, linear_dims
from lowbit_ao.nvfp4 import BLOCK as NVFP4_BLOCK
from lowbit_ao.nvfp4 import NVFP4Settings, hadamard_16, nvfp4_linear, random_signs
from lowbit_ao.quiet_import import import_torchao

MXFP8_BLOCK = 32
BLOCK_SIZES = {"mxfp8": MXFP8_BLOCK, "nvfp4": NVFP4_BLOCK}


class BlockScaled:
    """Mixed into a converted layer's class: the forward runs ``_lowbit_block_gemm``."""

    _lowbit_block_recipe: str = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self._lowbit_conv1d else self.weight  # Conv1D stores (in, out)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            out = self._lowbit_block_gemm(*block_operands(x, weight, self._lowbit_block_native)).to(dtype)
        return out if self.bias is None else out + self.bias.to(dtype)


def block_operands(x: torch.Tensor, weight: torch.Tensor, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands the GEMMs take. torchao's sm_100 MXFP8 kernels cast only contiguous bf16
    tensors (torchao 0.18 ``prototype/mx_formats/kernels.py``: ``triton_to_mxfp8_dim0`` asserts
    both), whatever autocast says, and a Conv1D's weight arrives transposed: so the native path
    gets contiguous bf16 copies. Emulation quantizes and multiplies in fp32 (the quantized values
    are exact there), which is also the fast path on CPUs without bf16."""
    if native:
        return x.to(torch.bfloat16).contiguous(), weight.to(torch.bfloat16).contiguous()
    return x.float(), weight.float()


_CLASSES: dict[type, type] = {}


def _block_class(base: type) -> type:
    """``BlockScaledLinear`` for nn.Linear (``BlockScaledConv1D`` for Conv1D), made once per class
    and kept in this module, so a converted model can still be pickled whole."""
    if base not in _CLASSES:
        name = f"BlockScaled{base.__name__}"
        cls = type(name, (BlockScaled, base), {"__module__": __name__, "__qualname__": name})
        globals()[name] = _CLASSES[base] = cls
    return _CLASSES[base]


def _mxfp8_gemm(options: Any, emulated: bool):
    import_torchao("torchao.prototype.moe_training.mxfp8_linear")
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    kernels = KernelPreference.EMULATED if emulated else KernelPreference.AUTO
    rounding = ScaleCalculationMode.RCEIL if options.mx_scale_rounding == "rceil" else ScaleCalculationMode.FLOOR

    def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _to_mxfp8_then_scaled_mm(x, weight, kernel_preference=kernels, scale_calculation_mode=rounding)

    return gemm


def _nvfp4_gemm(options: Any, layer_index: int, device: torch.device):
    settings = NVFP4Settings(
        weight_2d=options.nvfp4_2d_weight_scaling,
        stochastic_rounding=options.nvfp4_stochastic_rounding,
        random_hadamard=options.nvfp4_random_hadamard,
    )
    transform = hadamard_16(random_signs(layer_index)).to(device)  # once here, not a copy per backward

    def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return nvfp4_linear(x, weight, settings, transform)

    return gemm


def weight_problem(recipe: str, in_features: int, out_features: int) -> str:
    block = BLOCK_SIZES[recipe]
    if in_features % block or out_features % block:
        return f"dims {in_features}x{out_features} not divisible by {block} ({recipe}'s block)"
    return ""


def convert_block_layers(
    model: nn.Module, candidates: list[str], skipped: dict[str, str], context: PrepareContext
) -> list[str]:
    """Convert the ``candidates`` (Linear / Conv1D names, module order) that are not ``skipped``;
    add to ``skipped`` the reason for each one that stays in high precision. Returns the converted."""
    options = context.backend_options
    recipe = options.recipe
    if recipe == "nvfp4":
        for name, why in fp4_layers_kept_bf16(candidates, options.fp4_last_layers_bf16).items():
            skipped.setdefault(name, why)
    emulated = context.recipe_runs == "emulated"
    conv1d = conv1d_class()
    modules = dict(model.named_modules())
    converted = []
    for index, name in enumerate(candidates):
        if name in skipped:
            continue
        module = modules[name]
        problem = weight_problem(recipe, *linear_dims(module))
        if problem:
            skipped[name] = problem
            continue
        module.__class__ = _block_class(type(module))
        module._lowbit_conv1d = conv1d is not None and isinstance(module, conv1d)
        module._lowbit_block_recipe = recipe
        module._lowbit_block_native = recipe == "mxfp8" and not emulated
        module._lowbit_block_gemm = (
            _mxfp8_gemm(options, emulated) if recipe == "mxfp8" else _nvfp4_gemm(options, index, context.device)
        )
        pad_tokens(module, BLOCK_SIZES[recipe])
        converted.append(name)
    return converted


def block_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, BlockScaled)]
