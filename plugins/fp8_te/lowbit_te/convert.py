"""Swap nn.Linear / nn.LayerNorm / nn.RMSNorm for their Transformer Engine versions."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn

from lowbit.types import PrepareContext
from lowbit_te.runtime import import_te

# TE's FP8 GEMM takes the weight as (out_features, in_features) and needs the leading dim to be a
# multiple of 8 and the last a multiple of 16 (transformer_engine/pytorch/utils.py,
# assert_dim_for_fp8_exec, called from module/linear.py): out_features % 8, in_features % 16.
OUT_MULTIPLE, IN_MULTIPLE = 8, 16


def has_te_modules(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


def _gathered(*params: torch.Tensor):
    """Under DeepSpeed ZeRO-3 a parameter built under ``zero.Init`` holds only a shard."""
    partitioned = [p for p in params if p is not None and hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def _copy(dst: torch.Tensor, src: torch.Tensor | None) -> None:
    with torch.no_grad():
        if src is None:
            dst.zero_()
        else:
            dst.copy_(src)


def _te_linear(te: Any, layer: nn.Linear) -> nn.Module:
    weight, bias = layer.weight, layer.bias
    with _gathered(weight, bias):
        new = te.Linear(layer.in_features, layer.out_features, bias=bias is not None, params_dtype=weight.dtype, device=weight.device)
        _copy(new.weight, weight)
        if bias is not None:
            _copy(new.bias, bias)
    return new


def _te_norm(te: Any, norm: nn.Module) -> nn.Module | None:
    weight = norm.weight
    with _gathered(weight, getattr(norm, "bias", None)):
        if isinstance(norm, nn.LayerNorm):
            new = te.LayerNorm(norm.normalized_shape, eps=norm.eps, params_dtype=weight.dtype, device=weight.device)
            _copy(new.bias, norm.bias)
        else:
            eps = norm.eps if norm.eps is not None else torch.finfo(weight.dtype).eps
            new = te.RMSNorm(norm.normalized_shape, eps=eps, params_dtype=weight.dtype, device=weight.device)
        _copy(new.weight, weight)
    return new


def convert(model: nn.Module, context: PrepareContext) -> nn.Module:
    te, _ = import_te()
    if has_te_modules(model):
        return model  # the user built it with TE already: leave it as it is
    options = context.fp8_options
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    skipped: dict[str, str] = {}
    if options.keep_first_last_high_precision and linears:
        skipped[linears[0]] = "first Linear kept in high precision"
        skipped[linears[-1]] = "last Linear kept in high precision"
    converted: list[str] = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            fqn = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear:
                if fqn in skipped:
                    continue
                if child.in_features % IN_MULTIPLE or child.out_features % OUT_MULTIPLE:
                    skipped[fqn] = (f"dims {child.in_features}x{child.out_features}: TE's FP8 GEMMs need in_features % 16 "
                                    "and out_features % 8")
                    continue
                setattr(module, child_name, _te_linear(te, child))
                converted.append(fqn)
            elif type(child) is nn.LayerNorm and child.elementwise_affine:
                if child.bias is None:
                    skipped[fqn] = "LayerNorm without bias (te.LayerNorm always has one)"
                    continue
                setattr(module, child_name, _te_norm(te, child))
                converted.append(fqn)
            elif hasattr(nn, "RMSNorm") and type(child) is nn.RMSNorm and child.elementwise_affine and hasattr(te, "RMSNorm"):
                setattr(module, child_name, _te_norm(te, child))
                converted.append(fqn)
    shape_skips = [n for n, why in skipped.items() if why.startswith("dims")]
    if shape_skips:
        warnings.warn(
            f"lowbit-te: {len(shape_skips)} Linear layer(s) kept in high precision because FP8 GEMMs cannot take "
            f"their shapes (in % 8, out % 16): {', '.join(shape_skips)}. All other layers were converted.",
            stacklevel=2,
        )
    model._lowbit_fp8_report = {"converted": converted, "skipped": skipped}
    return model
