"""Swap nn.Linear / nn.LayerNorm / nn.RMSNorm for their Transformer Engine versions."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from lowbit.kernel.plugin_api import (
    ConversionReport,
    ConvertedModel,
    LayerRole,
    LayerRoles,
    PrepareContext,
    UnsupportedCombinationError,
    fp4_layers_kept_bf16,
    note,
)

from lowbit_te.fp8_state import keep_pickles_out_of_state_dicts
from lowbit_te.gemm_rules import pad_tokens_for_fp8, token_multiple, weight_problem
from lowbit_te.runtime import import_te


def has_te_modules(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


def _gathered(*params: torch.Tensor | None):
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


def _adopt(new: nn.Module, old: nn.Module, names: tuple[str, ...]) -> None:
    """Give the TE module the original layer's Parameters, the same objects: a weight tied to an
    embedding (Llama's ``tie_word_embeddings``, GPT-2's head) stays tied, and the optimizer keeps
    its parameters. TE's constructor made Parameters of its own (module/linear.py); attributes it
    set on them (tensor-parallel markers) move to the adopted ones. Under ZeRO-3 a partitioned
    parameter is copied instead: DeepSpeed owns those objects."""
    for name in names:
        mine, theirs = getattr(old, name, None), getattr(new, name, None)
        if not isinstance(mine, nn.Parameter) or not isinstance(theirs, nn.Parameter):
            continue  # no bias: TE keeps an empty plain tensor
        if hasattr(mine, "ds_id"):
            with _gathered(mine):
                _copy(theirs, mine)
            continue
        for key, value in vars(theirs).items():
            if not hasattr(mine, key):
                setattr(mine, key, value)
        setattr(new, name, mine)


def _te_linear(te: Any, layer: nn.Linear) -> nn.Module:
    weight = layer.weight
    with _gathered(weight):  # the shape and dtype of a ZeRO-3 shard are those of the full weight once gathered
        new = te.Linear(
            layer.in_features,
            layer.out_features,
            bias=layer.bias is not None,
            params_dtype=weight.dtype,
            device=weight.device,
        )
    _adopt(new, layer, ("weight", "bias"))
    return new


def rms_norm_eps(norm: nn.Module) -> float:
    """nn.RMSNorm's eps=None means the epsilon of the op-math type (fp32 for bf16 and fp16 inputs:
    aten's rms_norm uses ``numeric_limits<opmath_type>::epsilon``); TE needs a number."""
    if norm.eps is not None:
        return norm.eps
    dtype = norm.weight.dtype if norm.weight is not None else torch.get_default_dtype()
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _te_norm(te: Any, norm: nn.Module) -> nn.Module:
    weight = norm.weight
    with _gathered(weight):
        if isinstance(norm, nn.LayerNorm):
            new = te.LayerNorm(norm.normalized_shape, eps=norm.eps, params_dtype=weight.dtype, device=weight.device)
        else:
            new = te.RMSNorm(
                norm.normalized_shape, eps=rms_norm_eps(norm), params_dtype=weight.dtype, device=weight.device
            )
    _adopt(new, norm, ("weight", "bias") if isinstance(norm, nn.LayerNorm) else ("weight",))
    return new


def refuse_published_fp8(roles: LayerRoles) -> None:
    """Layers published in FP8 (transformers' FP8Linear) are not TE modules, and converting them
    would dequantize the checkpoint's FP8 data and quantize it again: refused by name."""
    published = roles.named(LayerRole.FP8_PUBLISHED)
    if published:
        raise UnsupportedCombinationError(
            f"lowbit-te cannot run layers published in FP8 ({len(published)}, the first: {published[0]}): TE "
            "has no module that takes an FP8 checkpoint's weight and block scales as they are, and lowbit never "
            "quantizes such a layer again. Use the ao backend (AORecipeKwargs()), which runs them with their own "
            "scales, or load the checkpoint in bf16."
        )


def convert(
    model: nn.Module, context: PrepareContext, layer_roles: LayerRoles | None = None
) -> nn.Module | ConvertedModel:
    from lowbit.kernel.layer_roles import classify_layers

    te, _ = import_te()
    if has_te_modules(model):
        keep_pickles_out_of_state_dicts(model)
        return model  # the user built it with TE already: leave it as it is
    options = context.backend_options
    roles = layer_roles if layer_roles is not None else classify_layers(model)
    refuse_published_fp8(roles)
    adapters = set(roles.named(LayerRole.ADAPTER))  # never converted, and not counted by the first/last rule
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear and name not in adapters]
    skipped: dict[str, str] = {}
    if options.keep_first_last_high_precision and linears:
        skipped[linears[0]] = "first Linear kept in high precision"
        skipped[linears[-1]] = "last Linear kept in high precision"
    if context.mixed_precision == "fp4":
        for name, why in fp4_layers_kept_bf16(linears, options.fp4_last_layers_bf16).items():
            skipped.setdefault(name, why)
    converted: list[str] = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            fqn = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear:
                if fqn in skipped or fqn in adapters:
                    continue
                problem = weight_problem(child.in_features, child.out_features, options)
                if problem:
                    skipped[fqn] = problem
                    continue
                new = _te_linear(te, child)
                if options.pad_tokens:
                    pad_tokens_for_fp8(new, token_multiple(options))
                setattr(module, child_name, new)
                converted.append(fqn)
            elif type(child) is nn.LayerNorm and child.elementwise_affine:
                if child.bias is None:
                    skipped[fqn] = "LayerNorm without bias (te.LayerNorm always has one)"
                    continue
                setattr(module, child_name, _te_norm(te, child))
                converted.append(fqn)
            elif (
                hasattr(nn, "RMSNorm")
                and type(child) is nn.RMSNorm
                and child.elementwise_affine
                and hasattr(te, "RMSNorm")
            ):
                setattr(module, child_name, _te_norm(te, child))
                converted.append(fqn)
    shape_skips = [n for n, why in skipped.items() if why.startswith("dims")]
    if shape_skips:
        note(
            f"lowbit-te: {len(shape_skips)} Linear layer(s) kept in high precision because FP8 GEMMs cannot take "
            f"their shapes: {', '.join(f'{n} ({skipped[n]})' for n in shape_skips)}. "
            "All other layers were converted."
        )
    keep_pickles_out_of_state_dicts(model)
    padding = (
        f"token count padded to a multiple of {token_multiple(options)} where needed (pad_tokens)"
        if options.pad_tokens and any(n for n in converted if isinstance(model.get_submodule(n), te.Linear))
        else ""
    )
    recipe = options.recipe if options.te_recipe is None else type(options.te_recipe).__name__
    frozen = [name for name in converted if roles.of(name) is LayerRole.FROZEN_BASE]
    if frozen:
        # TE computes no weight gradient for a weight that needs none (module/linear.py, _Linear.forward:
        # ctx.requires_wgrad = weight.requires_grad; TE 1.x to 2.x); the weight itself stays in high precision.
        note(
            f"lowbit-te: {len(frozen)} frozen base(s) run in FP8 without a weight-gradient GEMM (TE skips it for a "
            "weight that needs no gradient); their weights stay in high precision: lowbit-te does not build them "
            "under TE's quantized_model_init. For frozen bases stored in FP8 (half the memory), use the ao backend."
        )
    held = sum(
        model.get_submodule(name).weight.numel() * model.get_submodule(name).weight.element_size() for name in frozen
    )
    report = ConversionReport([n for n in converted if n not in frozen], skipped, recipe=recipe, padding=padding)
    report.frozen_low_precision, report.frozen_bytes = frozen, (held, held)
    return ConvertedModel(model, report)
