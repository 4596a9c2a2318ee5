"""Tensor parallelism for the built-in strategies: each module a plan names is laid out on the
mesh's ``tp`` dimension with torch's ``parallelize_module``.

The plan is the one the user gives (``TorchTensorParallelConfig(plan=...)``), else the model's own
(a transformers model's ``_tp_plan``: module name patterns -> style names such as "colwise").
A low-precision backend may lay out the modules it converted its own way (torchao's float8 styles
cast the input to float8 before the collective): its ``tensor_parallel_style`` integration is asked
first, module by module.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Mapping

from lowbit.kernel.errors import ConfigError
from lowbit.kernel.types import PrepareContext

if TYPE_CHECKING:  # the built-in strategies load at discovery, which imports no torch
    from torch import nn


def _plain_styles() -> dict[str, tuple[Callable[[], Any], int | None]]:
    """The plan style names lowbit lays out with torch's own styles (transformers' names): each
    one's maker, and the weight dimension it splits over the ranks."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": (ColwiseParallel, 0),
        "rowwise": (RowwiseParallel, 1),
        # An output layer whose full output every rank needs (the loss): gathered after the GEMM.
        "colwise_gather_output": (lambda: ColwiseParallel(output_layouts=Replicate()), 0),
        "colwise_rep": (lambda: ColwiseParallel(output_layouts=Replicate()), 0),
        "rowwise_rep": (lambda: RowwiseParallel(output_layouts=Replicate()), 1),
        # The vocabulary is split; each rank's lookups are summed.
        "embedding_rowwise": (lambda: RowwiseParallel(input_layouts=Replicate()), 0),
        "sequence_parallel": (SequenceParallel, None),
    }


def plan_for(model: nn.Module, context: PrepareContext) -> Mapping[str, Any]:
    handler = getattr(context.parallelism, "tp_handler", None)
    plan = getattr(handler, "plan", None) or getattr(model, "_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"tp_size={context.parallelism.tp_size} asks for tensor parallelism, but {type(model).__name__} has no "
            "tensor-parallel plan (transformers models carry one as `_tp_plan`). Give one: "
            "ParallelismConfig(tp_size=..., tp_handler=TorchTensorParallelConfig(plan={'layers.*.mlp.up_proj': "
            "'colwise', ...}))."
        )
    return plan


def expand_plan(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """The plan by module name; ``*`` in a pattern matches one part of a name (a block's index)."""
    names = [name for name, _ in model.named_modules() if name]
    layout: dict[str, Any] = {}
    for pattern, style in plan.items():
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        layout.update({name: style for name in names if regex.match(name)})
    if not layout:
        raise ConfigError(
            f"The tensor-parallel plan names no module of {type(model).__name__} "
            f"(patterns: {', '.join(list(plan)[:4])}...); its modules are named like {', '.join(names[:4])}."
        )
    return layout


def _check_divides(name: str, module: nn.Module, dim: int | None, tp: int) -> None:
    """A split dimension must divide by the ranks: attention heads and GEMM shapes would not fit
    otherwise (torch would shard unevenly and the model's reshapes fail mid-forward)."""
    weight = getattr(module, "weight", None)
    if dim is not None and weight is not None and weight.ndim == 2 and weight.shape[dim] % tp:
        raise ConfigError(
            f"Tensor parallelism splits {name}'s weight {tuple(weight.shape)} along dimension {dim} into "
            f"{tp} parts, but {weight.shape[dim]} does not divide by {tp}. Choose a tp_size that divides it."
        )


def _check_heads(model: nn.Module, tp: int) -> None:
    """Each rank computes whole attention heads: a transformers config's head counts must divide."""
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(
                f"Tensor parallelism gives each of the {tp} ranks whole attention heads, but the model's "
                f"{key} is {heads}, which does not divide by {tp}. Choose a tp_size that divides it."
            )


def apply_tensor_parallel(model: nn.Module, context: PrepareContext) -> nn.Module:
    """Lay ``model`` out on the ``tp`` dimension of the run's mesh (no-op when tp_size is 1)."""
    parallelism = context.parallelism
    if parallelism is None or not parallelism.tp_enabled:
        return model
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    if any(isinstance(p, DTensor) for p in model.parameters()):
        # Loaded already laid out (transformers' from_pretrained(tp_plan="auto", device_mesh=...)).
        size = getattr(model, "tp_size", None)
        if size not in (None, parallelism.tp_size):
            raise ConfigError(
                f"The model was loaded tensor-parallel over {size} ranks, but tp_size is {parallelism.tp_size}."
            )
        return model
    _check_heads(model, parallelism.tp_size)
    modules = dict(model.named_modules())
    backend_style = context.strategy_integration.tensor_parallel_style
    plain = _plain_styles()
    layout = {}
    for name, style in expand_plan(model, plan_for(model, context)).items():
        if not isinstance(style, str):
            layout[name] = style  # a torch ParallelStyle the user gave
            continue
        if style not in plain:
            raise ConfigError(
                f"The tensor-parallel plan lays {name} out as {style!r}, which lowbit does not offer "
                f"(it does: {', '.join(plain)}). Give a plan with those, or torch ParallelStyle objects."
            )
        make, split_dim = plain[style]
        _check_divides(name, modules[name], split_dim, parallelism.tp_size)
        chosen = backend_style(modules[name], style) if backend_style else None
        layout[name] = chosen if chosen is not None else make()
    return parallelize_module(model, context.device_mesh["tp"], layout)


def tell_transformers_the_layout(model: nn.Module, context: PrepareContext) -> None:
    """A transformers model's ``save_pretrained`` gathers sharded weights (to rank 0, on the CPU)
    only when its config says how it is laid out (``config.distributed_config``, which transformers
    sets itself when it lays the model out at load time). Say it for a layout lowbit made, so that
    ``model.save_pretrained(...)`` on every rank writes whole weights once. The key is never saved."""
    layout, config = context.parallelism, getattr(model, "config", None)
    if layout is None or config is None or getattr(config, "distributed_config", None) is not None:
        return
    try:
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError:  # not a transformers model, or a transformers without distributed saving
        return
    sharded = layout.dp_shard_enabled or layout.cp_enabled
    config.distributed_config = DistributedConfig(
        tp_size=layout.tp_size,
        fsdp_size=layout.dp_shard_size * layout.cp_size if sharded else None,
        dp_replicate_size=layout.dp_replicate_size if sharded else None,
    )
