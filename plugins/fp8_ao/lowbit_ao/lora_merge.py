"""Merging LoRA adapters into frozen FP8 bases: ``dequant(W) + ΔW``, out of place, in high precision.

PEFT's ``merge()`` adds the adapter's delta to the base weight in place (``weight.data += ΔW``) and
``unmerge()`` subtracts it again: on FP8 data that would round twice and leave a different base
behind. Here the base's FP8 data and scales are only read; the merged weight is a new tensor, in
the dtype the weight had before quantization (bf16 for a layer published in FP8), or, with
``requantize=True``, quantized again in the base's own format (per tensor or per 128x128 block,
with the scale dtype the checkpoint used: float32 or UE8M0), for an FP8 checkpoint of the merged model.

    from lowbit_ao.lora_merge import merged_state_dict
    state = merged_state_dict(accelerator.unwrap_model(model))          # plain names, merged weights
    LlamaForCausalLM(config).load_state_dict(state)                     # a model without PEFT
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit_ao.frozen_base import FrozenFP8Linear, quantize_tensorwise, quantize_weight_blocks

# PEFT's wrappers around the model and around each adapted layer, dropped from the merged names.
PEFT_PREFIX = "base_model.model."
PEFT_BASE = ".base_layer"


def plain_name(name: str) -> str:
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(PEFT_BASE + ".", ".").removesuffix(PEFT_BASE)


def in_base_format(weight: torch.Tensor, base: FrozenFP8Linear) -> dict[str, torch.Tensor]:
    """``weight`` quantized as ``base`` stores its own: the same format and scale dtype."""
    data, scale = quantize_weight_blocks(weight) if base.format == "blocks128" else quantize_tensorwise(weight)
    stored = base.weight_scale_inv
    if stored.dtype != scale.dtype:  # UE8M0 scales: each rounded up to a power of two, the data made to match
        rounded = torch.exp2(torch.ceil(torch.log2(scale)))
        if base.format == "blocks128":
            data, _ = quantize_weight_blocks(weight, scale_inv=rounded)
        else:
            data = (weight.float() / rounded).clamp(-448, 448).to(data.dtype)
        scale = rounded.to(stored.dtype)
    return {"weight": data, "weight_scale_inv": scale.reshape(stored.shape)}


def _merged_weight(layer: nn.Module, base: nn.Module, dtype: torch.dtype | None) -> torch.Tensor:
    if isinstance(base, FrozenFP8Linear):  # in the layout PEFT's delta has (a Conv1D's is transposed)
        weight = base.dequantized_weight(
            dtype or (torch.bfloat16 if base.published else base.original_dtype), as_stored_before=True
        )
    else:
        weight = base.weight.detach().to(dtype or base.weight.dtype, copy=True)
    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "lora_A", {}):
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def merged_state_dict(
    model: nn.Module, *, requantize: bool = False, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The model's state dict with every active LoRA adapter merged into its base, under the plain
    model's names (no PEFT wrappers, no adapter weights). Frozen FP8 bases without an adapter are
    dequantized too, unless ``requantize`` keeps every FP8 base in FP8 (a merged one quantized again
    in its own format). ``dtype``: the merged weights' dtype (default: each base's own)."""
    state = model.state_dict()
    out: dict[str, Any] = {}
    done: set[str] = set()
    merged_bases: set[int] = set()
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if id(module) in merged_bases:
            continue
        if base is not None and hasattr(module, "get_delta_weight"):
            merged_bases.add(id(base))
            merged = _merged_weight(module, base, dtype)
            target = plain_name(name)
            if requantize and isinstance(base, FrozenFP8Linear):
                out.update({f"{target}.{k}": v for k, v in in_base_format(merged, base).items()})
            else:
                out[f"{target}.weight"] = merged
            if base.bias is not None:
                out[f"{target}.bias"] = base.bias.detach()
            done.update(key for key in state if key.startswith(f"{name}."))
        elif isinstance(module, FrozenFP8Linear) and not requantize:
            out[f"{plain_name(name)}.weight"] = module.dequantized_weight(dtype, as_stored_before=True)
            done.update({f"{name}.weight", f"{name}.weight_scale_inv", f"{name}.activation_scale"})
    for key, value in state.items():
        if key not in done and ".lora_" not in key:
            out.setdefault(plain_name(key), value)
    return out
