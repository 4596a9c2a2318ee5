"""Activation checkpointing of a model's blocks: their activations are freed after forward and
recomputed in backward, so a long sequence fits.

``full``: everything inside a block is recomputed (Accelerate's ``activation_checkpointing=True``).
``selective``: torchtitan's per-op policy: the outputs of matmuls, attention and collectives are
kept (expensive to redo), the rest is recomputed: norms, activations and low-precision casts (a
float8 cast is recomputed from the high-precision values, as it would be computed the first time).

Each block's ``forward`` runs under ``torch.utils.checkpoint`` (no wrapper module, so parameter
names and state dicts are unchanged, and FSDP2's hooks on the block stay outside the region).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowbit.notices import note

if TYPE_CHECKING:  # the built-in strategies load at discovery, which imports no torch
    from torch import nn

MODES = (False, True, "full", "selective")


def _kept_ops() -> set[Any]:
    import torch

    aten, ops = torch.ops.aten, []
    for name in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.append(getattr(aten, name).default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"):
        if functional is not None and hasattr(functional, name):
            ops.append(getattr(functional, name).default)
    return set(ops)


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = _kept_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module], mode: Any) -> None:
    """Checkpoint each block of ``model`` in ``mode`` (one of ``MODES``; False does nothing)."""
    if mode is False or not blocks:
        return
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        # A block recomputed in backward would append its keys and values to the cache a second time
        # and attend over both (selective checkpointing then fails; transformers turns the cache
        # off under its own gradient checkpointing for the same reason).
        config.use_cache = False
        note(f"{type(model).__name__}.config.use_cache set to False: activation checkpointing recomputes each block, "
             "and a key/value cache would be filled twice. Training needs no cache.")
    for block in blocks:
        _checkpoint_forward(block, _selective_context if mode == "selective" else None)


def _checkpoint_forward(block: nn.Module, context_fn: Any) -> None:
    """The block's own ``forward`` runs under ``torch.utils.checkpoint`` (non-reentrant). Its
    module hooks (FSDP2's gathers and casts) stay outside the checkpointed region, so the recompute
    meets exactly the forward's ops; names and state dicts are unchanged (no wrapper module)."""
    from torch.utils.checkpoint import checkpoint

    original = block.forward
    options = {"context_fn": context_fn} if context_fn is not None else {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, *args, use_reentrant=False, **options, **kwargs)

    block.forward = forward
