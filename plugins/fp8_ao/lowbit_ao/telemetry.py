"""FP8 telemetry for torchao's Float8Linear: the casts torchao makes, with torchao's own scales."""
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


def enable(model: nn.Module, recorder: Any) -> bool:
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
                output.register_hook(lambda g, name=name: recorder.record(
                    name, "grad_output", g, e5m2_dtype, _scale(g, e5m2_dtype, config.cast_config_grad_output)))

        recorder.removers.append(layer.register_forward_hook(on_forward))
    return True
