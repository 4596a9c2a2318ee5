"""FP8 telemetry for torchao's Float8Linear (the casts torchao makes, with torchao's own scales) and
for the block-scaled layers (MXFP8, NVFP4): per block, whether its scale saturates or underflows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _scale(x: torch.Tensor, fp8_dtype: torch.dtype, cast_config: Any) -> torch.Tensor:
    """The scale torchao computes for this cast (dynamic: from the tensor's own amax)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import amax_to_scale

    x = x.detach().float()
    if cast_config.scaling_granularity is ScalingGranularity.AXISWISE:
        amax = x.abs().amax(dim=-1, keepdim=True)
    else:
        amax = x.abs().amax()
    return amax_to_scale(amax, fp8_dtype)


# Scale ranges. MXFP8: a power of two 2^e, e in [-127, 127] (E8M0; OCP MX v1.0). NVFP4: an E4M3
# value; below half its smallest subnormal (2^-9) it rounds to zero, and it rounds to its largest
# value (448) up to 448 + half the top spacing (32 / 2), beyond which it saturates.
E8M0_RANGE = (2.0**-127, 2.0**127)
NVFP4_SCALE_RANGE = (2.0**-10, 464.0)


def _mxfp8_scale(rounding: str):
    """The power-of-two scale a block gets from its amax: ``rceil`` rounds amax/448 up, the OCP
    spec's ``floor`` takes 2^(floor(log2 amax) - 8) (E4M3's largest exponent is 8)."""

    def wanted(block_amax: torch.Tensor) -> torch.Tensor:
        safe = block_amax.clamp(min=torch.finfo(torch.float32).tiny)
        exponent = torch.ceil(torch.log2(safe / 448.0)) if rounding == "rceil" else torch.floor(torch.log2(safe)) - 8
        return torch.where(block_amax > 0, torch.exp2(exponent), torch.ones_like(block_amax))

    return wanted


def _nvfp4_scale(tensor: torch.Tensor):
    """The E4M3 block scale NVFP4 stores: amax_block / 6 times the tensor's global scale."""
    from lowbit_ao.nvfp4 import E2M1_MAX, global_scale

    scale = global_scale(tensor.detach().abs().amax())
    return lambda block_amax: block_amax / E2M1_MAX * scale


def _block_stats(recipe: str, x: torch.Tensor, rounding: str) -> Any:
    from lowbit.kernel.plugin_api import block_cast_stats

    from lowbit_ao.block_formats import BLOCK_SIZES

    x = x.detach().reshape(-1, x.shape[-1])
    block = BLOCK_SIZES[recipe]
    if x.shape[-1] % block:
        x = torch.nn.functional.pad(x, (0, (-x.shape[-1]) % block))  # tokens: padded like the layer pads them
    if recipe == "mxfp8":
        return block_cast_stats(x, block, _mxfp8_scale(rounding), *E8M0_RANGE)
    return block_cast_stats(x, block, _nvfp4_scale(x), *NVFP4_SCALE_RANGE)


def enable_blocks(layers: list[tuple[str, nn.Module]], recorder: Any, rounding: str) -> None:
    """Per block-scaled layer: its input, weight and output gradient, as the forward GEMM and the
    input-gradient GEMM block them (along the last dim)."""
    for name, layer in layers:
        recipe = layer._lowbit_block_recipe

        def on_forward(module, args, output, name=name, recipe=recipe):
            if not recorder.active:
                return
            recorder.record_stats(name, "input", _block_stats(recipe, args[0], rounding))
            weight = module.weight.t() if module._lowbit_conv1d else module.weight
            recorder.record_stats(name, "weight", _block_stats(recipe, weight, rounding))
            if output.requires_grad:
                output.register_hook(
                    lambda g, name=name: recorder.record_stats(name, "grad_output", _block_stats(recipe, g, rounding))
                )

        recorder.removers.append(layer.register_forward_hook(on_forward))


def enable(model: nn.Module, recorder: Any, options: Any = None) -> bool:
    from lowbit_ao.block_formats import block_layers

    blocks = block_layers(model)
    if blocks:
        enable_blocks(blocks, recorder, getattr(options, "mx_scale_rounding", "rceil"))
        return True
    from torchao.float8.config import e4m3_dtype, e5m2_dtype
    from torchao.float8.float8_linear import Float8Linear

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    for name, layer in layers:
        config = layer.config

        def on_forward(module, args, output, name=name, config=config):
            if not recorder.active:
                return  # unsampled steps cost one Python call per layer, nothing on the autograd graph
            x = args[0]
            recorder.record(name, "input", x, e4m3_dtype, _scale(x, e4m3_dtype, config.cast_config_input))
            weight = module.linear_weight() if hasattr(module, "linear_weight") else module.weight  # Conv1D: (in, out)
            recorder.record(name, "weight", weight, e4m3_dtype, _scale(weight, e4m3_dtype, config.cast_config_weight))
            if output.requires_grad:
                # The gradient of the output is the grad_output torchao casts to e5m2 in backward.
                output.register_hook(
                    lambda g, name=name: recorder.record(
                        name, "grad_output", g, e5m2_dtype, _scale(g, e5m2_dtype, config.cast_config_grad_output)
                    )
                )

        recorder.removers.append(layer.register_forward_hook(on_forward))
    return True
