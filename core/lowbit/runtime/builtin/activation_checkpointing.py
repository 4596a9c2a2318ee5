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

from typing import TYPE_CHECKING, Any, Callable

from lowbit.kernel.errors import ConfigError
from lowbit.kernel.notices import note

if TYPE_CHECKING:  # the built-in strategies load at discovery, which imports no torch
    from torch import nn

MODES = (False, True, "full", "selective")


def _kept_ops() -> set[Any]:
    import torch

    aten, ops = torch.ops.aten, []
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
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


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module], mode: Any, recompute: Callable | None = None) -> None:
    """Checkpoint each block of ``model`` in ``mode`` (one of ``MODES``; False does nothing).
    ``recompute``: the low-precision backend's own drop-in for ``torch.utils.checkpoint.checkpoint``
    (Transformer Engine's recomputes under the forward's FP8 settings and scales), else torch's."""
    if mode is False or not blocks:
        return
    if recompute is not None and mode == "selective":
        raise ConfigError(
            "activation_checkpointing='selective' keeps chosen ops through torch's own checkpoint, but "
            "this FP8 backend recomputes through its own (e.g. Transformer Engine's, which restores its "
            "FP8 scales). Use activation_checkpointing=True (full)."
        )
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        # A block recomputed in backward would append its keys and values to the cache a second time
        # and attend over both (selective checkpointing then fails; transformers turns the cache
        # off under its own gradient checkpointing for the same reason).
        config.use_cache = False
        note(
            f"{type(model).__name__}.config.use_cache set to False: activation checkpointing recomputes each block, "
            "and a key/value cache would be filled twice. Training needs no cache."
        )
    if recompute is None:
        from torch.utils.checkpoint import checkpoint as recompute
    options = {"context_fn": _selective_context} if mode == "selective" else {}
    for block in blocks:
        _checkpoint_forward(block, recompute, options)


def _checkpoint_forward(block: nn.Module, recompute: Callable, options: dict[str, Any]) -> None:
    """The block's own ``forward`` runs under ``recompute`` (non-reentrant). Its module hooks
    (FSDP2's gathers and casts) stay outside the checkpointed region, so the recompute meets exactly
    the forward's ops; names and state dicts are unchanged (no wrapper module)."""
    original = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return recompute(original, *args, use_reentrant=False, **options, **kwargs)

    block.forward = forward
