"""Which frozen layers lowbit-ao stores and runs in FP8 (:mod:`lowbit_ao.frozen_base`), decided at prepare().

The roles come from the core (``layer_roles``): a frozen base (a Linear whose weight needs no
gradient) is quantized once, unless a rule keeps it (the first/last rule, ``module_filter_func``,
dims FP8 GEMMs cannot take, ``frozen_bases="high_precision"``); a layer published in FP8 is adopted
with its own scales, or refused by name when its format is not one lowbit runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lowbit.kernel.plugin_api import (
    ConfigError,
    ConversionReport,
    LayerRole,
    LayerRoles,
    PrepareContext,
    UnsupportedCombinationError,
    note,
)

from lowbit_ao.conv1d import is_conv1d, linear_dims
from lowbit_ao.fast_emulation import compute_dtype_for
from lowbit_ao.frozen_base import (
    FrozenFP8Linear,
    FrozenGemms,
    dequantize,
    frozen,
    published_base,
    published_problem,
    quantized_base,
)
from lowbit_ao.gemm_rules import SCALED_MM_MULTIPLE


@dataclasses.dataclass
class FrozenConversion:
    """What became of the frozen layers: those now in FP8, those kept (with why), and the bytes
    their weights held before and hold now."""

    converted: list[str] = dataclasses.field(default_factory=list)
    kept: dict[str, str] = dataclasses.field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0

    def reported(self, report: ConversionReport) -> ConversionReport:
        report.frozen_low_precision = list(self.converted)
        report.frozen_bytes = (self.bytes_before, self.bytes_after)
        return report


def frozen_format(recipe: str) -> str:
    """How this recipe's frozen bases are stored: per tensor for tensorwise; 128x128 blocks for the
    others (a per-row weight scale does not transpose for the input-gradient GEMM; lowbit-ao has no
    frozen MXFP8 or NVFP4 base)."""
    return "tensorwise" if recipe == "tensorwise" else "blocks128"


def frozen_gemms(context: PrepareContext) -> FrozenGemms:
    """torch._scaled_mm on a CUDA GPU with FP8 GEMMs (unless emulate=True), else the emulation."""
    options = context.backend_options
    native = context.device.type == "cuda" and context.hardware.has_fp8_gemm and options.emulate is not True
    compute = compute_dtype_for(context.device) if options.emulation == "fast" else torch.float32
    return FrozenGemms(native=native, compute_dtype=compute)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _refuse_under(context: PrepareContext, names: list[str]) -> None:
    if context.strategy == "deepspeed" and names:
        raise UnsupportedCombinationError(
            f"lowbit-ao stores {len(names)} frozen layer(s) in FP8 (the first: {names[0]}), and DeepSpeed casts "
            "every floating-point parameter of the model to its bf16/fp16 dtype, which would turn the FP8 data into "
            "numbers without their scales. Use FSDP2 (which shards and gathers FP8 bases as they are), or keep "
            "frozen bases in high precision: AORecipeKwargs(frozen_bases='high_precision') (a layer published in "
            "FP8 cannot be kept: load that checkpoint in bf16)."
        )


def convert_frozen_layers(
    model: nn.Module, roles: LayerRoles, recipe: str, rule_kept: dict[str, str], context: PrepareContext
) -> FrozenConversion:
    """Swap each frozen base the rules allow, and every FP8-published layer, for a FrozenFP8Linear."""
    options = context.backend_options
    result = FrozenConversion()
    gemms = frozen_gemms(context)
    fmt = frozen_format(recipe)
    published = roles.named(LayerRole.FP8_PUBLISHED)
    for name in published:
        layer = model.get_submodule(name)
        problem = published_problem(layer)
        if problem:
            raise UnsupportedCombinationError(
                f"lowbit-ao cannot run {name}, a layer published in FP8 ({type(layer).__name__}): {problem}. "
                "lowbit uses an FP8 checkpoint's layers with their own scales and never quantizes them again, so it "
                "leaves no such layer to a conversion. Load this checkpoint in bf16 (dequantized), or re-export it "
                "with e4m3 weights scaled per tensor or per 128x128 block."
            )
    bases = []
    for name in roles.named(LayerRole.FROZEN_BASE):
        if name in rule_kept:
            result.kept[name] = rule_kept[name]
        elif options.frozen_bases == "high_precision":
            result.kept[name] = "frozen base kept in high precision (frozen_bases='high_precision')"
        else:
            in_features, out_features = linear_dims(model.get_submodule(name))
            if in_features % SCALED_MM_MULTIPLE or out_features % SCALED_MM_MULTIPLE:
                result.kept[name] = f"dims {in_features}x{out_features} not divisible by {SCALED_MM_MULTIPLE}"
            else:
                bases.append(name)
    _refuse_under(context, published + bases)
    for name in published:
        _replace(model, name, published_base(model.get_submodule(name), gemms))
        result.converted.append(name)
        stored = model.get_submodule(name).stored_bytes()
        result.bytes_before += stored
        result.bytes_after += stored
    for name in bases:
        layer = model.get_submodule(name)
        weight = layer.weight.t() if is_conv1d(layer) else layer.weight
        if weight.is_meta:
            raise ConfigError(
                f"{name} is a frozen base whose weight is not loaded on this rank yet (the meta device); lowbit-ao "
                "quantizes a frozen base's weight once at prepare(), so it needs the values."
            )
        result.bytes_before += weight.numel() * weight.element_size()
        new = quantized_base(weight, frozen(layer.bias), fmt, gemms)
        new.conv1d_layout = is_conv1d(layer)
        result.bytes_after += new.stored_bytes()
        _replace(model, name, new)
        result.converted.append(name)
    if bases and fmt != frozen_format("tensorwise"):
        note(
            f"lowbit-ao stores {len(bases)} frozen base(s) in FP8 with 128x128 block scales under recipe={recipe!r}: "
            "its own weight scaling does not fit a weight that is never trained (a per-row scale does not transpose "
            "for the input-gradient GEMM; there is no frozen MXFP8/NVFP4 base)."
        )
    return result


def dequantized_state_dict(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict the plain model loads: each frozen base lowbit quantized goes back to a
    high-precision ``weight`` (dequantized, in the dtype it had; its scales left out). Layers
    published in FP8 stay as the checkpoint had them (the FP8 model class loads them)."""
    out = dict(state_dict)
    for name, module in model.named_modules():
        if not isinstance(module, FrozenFP8Linear) or module.published:
            continue
        prefix = f"{name}." if name else ""
        weight, scale = out.get(prefix + "weight"), out.pop(prefix + "weight_scale_inv", None)
        if weight is None or scale is None:
            continue
        plain = dequantize(weight, scale, module.original_dtype)  # the gathered tensors, not the module's shard
        out[prefix + "weight"] = plain.t().contiguous() if module.conv1d_layout else plain
    return out
