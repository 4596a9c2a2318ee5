"""FP8 for Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2 and its relatives).

Conv1D is a Linear whose weight is stored transposed: ``y = x @ W + b`` with ``W`` of shape
(in, out). torchao converts only ``nn.Linear``, so a GPT-2 would get no FP8 layer at all. The
transposed weight is exactly the operand torchao's FP8 matmul takes (it multiplies by
``linear.weight.t()``), so the Conv1D's own Parameter is handed to it as is: no copy, and the
state dict keeps the original names, shapes and layout, so ``save_model`` output loads into a
plain GPT-2 and the optimizer keeps the same Parameter objects.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lowbit_ao.quiet_import import import_torchao

import_torchao()
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args  # noqa: E402


def conv1d_class() -> type | None:
    """transformers' Conv1D, if transformers is already imported (a model cannot hold one otherwise;
    lowbit does not import transformers for a model that does not use it)."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    cls = conv1d_class()
    return cls is not None and type(module) is cls


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    in_features, out_features = module.weight.shape
    return in_features, out_features


class Float8Conv1D(Float8Linear):
    """A Conv1D computed with torchao's FP8 matmul. ``weight`` is the Conv1D's (in, out) Parameter."""

    @classmethod
    def from_conv1d(cls, conv: nn.Module, config: Any) -> "Float8Conv1D":
        in_features, out_features = conv.weight.shape
        # from_float reads only these four attributes; it wraps the weight for FSDP float8
        # all-gather when the config asks, whatever the weight's layout.
        as_linear = SimpleNamespace(
            in_features=in_features, out_features=out_features, weight=conv.weight, bias=conv.bias
        )
        layer = cls.from_float(as_linear, config=config)
        layer.nx, layer.nf = in_features, out_features  # Conv1D's own attribute names, read by transformers
        return layer

    def linear_weight(self) -> torch.Tensor:
        """The weight as an nn.Linear would hold it, (out, in): what telemetry scales row by row."""
        return self.weight.t()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            input = input.to(torch.get_autocast_dtype(device_type))
        output = matmul_with_hp_or_float8_args.apply(input, self.weight, self.linear_mm_config, self.config)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output


def convert_conv1d_layers(model: nn.Module, module_filter, config: Any) -> nn.Module:
    """Swap every Conv1D the filter accepts for a Float8Conv1D, in place. Returns the model (a new
    module only when the model itself is a Conv1D)."""
    if conv1d_class() is None:
        return model
    for name, module in list(model.named_modules()):
        if is_conv1d(module) and module_filter(module, name):
            converted = Float8Conv1D.from_conv1d(module, config)
            if not name:
                return converted
            model.set_submodule(name, converted)
    return model
