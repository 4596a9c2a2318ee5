"""``lowbit estimate-memory``: the memory one training process needs, per precision and strategy.

The model is built on the meta device (no memory, no download): a transformers config (a
``config.json`` or a directory holding one) or a ``module:factory`` that returns an
``nn.Module``. What is counted, per process:

- weights, gradients and optimizer states from the parameter count (what does not train, a LoRA
  model's base, has no gradient and no state; a backend that stores frozen bases in FP8 declares
  their bytes, ``frozen_linear``), at the bytes per parameter
  of the precision (master weights stay fp32 in every precision lowbit trains; a low-precision
  backend declares its own figures in ``BackendDescription.memory_per_parameter``), divided over
  the ranks as the strategy shards them, plus the buffers it adds (each strategy declares both
  in ``StrategyDescription.memory``: DDP's gradient buckets, a second copy of the gradients; the
  unsharded parameters of the largest block while it computes, FSDP2 and ZeRO-3; FSDP2's
  unsharded gradients waiting for their reduce-scatter, over gloo all of them);
- activations: the tensors autograd saves for backward, counted on a meta-device forward of one
  micro-batch (``--batch_size`` x ``--seq_len``); under bf16 autocast (bf16, fp8, fp4) the
  inputs saved by each Linear are half-width;
- the peak: a step's forward ends with the weights, the states and every activation alive; its
  backward trades activations for gradients; the optimizer step then holds the gradients and one
  parameter-sized temporary (foreach AdamW). So peak = weights + states + max(activations,
  gradients + temporary) (+ the strategy's buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lowbit.kernel.types import StrategyMemory

from lowbit.runtime.observe.model_spec import example_inputs, load_model_on_meta

# (weights, gradients, AdamW states) in bytes per parameter: fp32 master weights and fp32 states in every precision.
NATIVE_BYTES = {"no": (4.0, 4.0, 8.0), "fp16": (4.0, 4.0, 8.0), "bf16": (4.0, 4.0, 8.0)}
MB = 2**20


@dataclass
class Estimate:
    """Bytes for one process, by part, for one precision (and backend) and strategy."""

    label: str
    strategy: str
    ranks: int
    parameters: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float  # the strategy's own: DDP's gradient buckets, FSDP2's unsharded block
    step_temporary: float
    per_parameter: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0))
    # Buffers whose lifetime depends on timing (FSDP2's unsharded gradients wait for reduce-scatters
    # that run asynchronously): counted in ``peak``, left out of ``peak_low``.
    timing_buffers: float = 0.0

    @property
    def peak(self) -> float:
        """The peak with every buffer alive at once (the high end)."""
        return self.peak_low + self.timing_buffers

    @property
    def peak_low(self) -> float:
        """The peak when the asynchronous buffers are freed as they go (the low end)."""
        return (
            self.weights + self.optimizer + self.buffers + max(self.activations, self.gradients + self.step_temporary)
        )


def saved_activation_bytes(model: nn.Module, inputs: Any, low_precision_linears: bool) -> float:
    """Bytes autograd saves for backward in one forward (meta device: shapes only), plus the
    gradient of the output that backward starts with. Linear inputs count at 2 bytes per element
    when ``low_precision_linears`` (bf16 autocast)."""
    # storage -> (elements, element size): a tensor saved twice, or two views of one, count once
    saved: dict[int, tuple[int, int]] = {}
    linear_inputs: set[int] = set()

    weights = {p.untyped_storage()._cdata for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in weights:  # weights (and their transposed views) are counted as weights
            saved[storage._cdata] = (storage.nbytes() // t.element_size(), t.element_size())
        return t

    def mark(module, args):
        if args and torch.is_tensor(args[0]):
            linear_inputs.add(args[0].untyped_storage()._cdata)

    handles = [m.register_forward_pre_hook(mark) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    # Backward starts with the gradient of the model's output (the logits, for a language model)
    # allocated while every saved activation is still alive.
    logits = getattr(output, "logits", output)
    total = float(logits.numel() * logits.element_size()) if torch.is_tensor(logits) else 0.0
    del output, logits
    for key, (numel, size) in saved.items():
        total += numel * (2 if low_precision_linears and key in linear_inputs else size)
    if low_precision_linears:  # autocast keeps a bf16 copy of each Linear weight for the step
        total += 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return total


def frozen_linear_parameters(model: nn.Module) -> int:
    """Elements of the Linear weights that need no gradient and are no adapter's (LoRA's bases)."""
    from lowbit.kernel.layer_roles import LayerRole, classify_layers

    roles = classify_layers(model)
    return sum(model.get_submodule(name).weight.numel() for name in roles.named(LayerRole.FROZEN_BASE))


def _largest_block_parameters(model: nn.Module) -> int:
    """Parameters of the largest repeated block (FSDP2 shards each block; one is whole at a time)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return sum(p.numel() for p in model.parameters())
    return max(sum(p.numel() for p in block.parameters()) for block in max(lists, key=len))


def estimate(
    model: nn.Module,
    precision: str,
    strategy: str,
    memory: StrategyMemory,
    ranks: int,
    activations_fp32: float,
    activations_low: float,
    per_parameter: tuple[float, float, float],
    label: str,
    frozen_linear_bytes: float | None = None,
) -> Estimate:
    params = sum(p.numel() for p in model.parameters())
    # What does not train (a LoRA model's base) has no gradient and no optimizer state; its Linear
    # weights take ``frozen_linear_bytes`` each where the backend stores frozen bases its own way.
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_linear = frozen_linear_parameters(model)
    weight_b, grad_b, state_b = per_parameter
    frozen_b = weight_b if frozen_linear_bytes is None else frozen_linear_bytes
    shard, extra = (memory.shards_weights, memory.shards_gradients, memory.shards_optimizer), memory.buffers
    parts = ((params - frozen_linear) * weight_b + frozen_linear * frozen_b, trained * grad_b, trained * state_b)
    weights, gradients, optimizer = (part / (ranks if s and ranks > 1 else 1) for part, s in zip(parts, shard))
    # Over NCCL FSDP2 frees unsharded gradients block by block, so its "gradients" buffer is on
    # the high side there (measured over gloo only: no GPU here).
    sizes = {
        "buckets": trained * grad_b,
        "block": _largest_block_parameters(model) * weight_b,
        "gradients": trained * grad_b,
    }
    buffers = sum(sizes[name] for name in extra if name != "gradients") if ranks > 1 else 0.0
    timing = sizes["gradients"] if ranks > 1 and "gradients" in extra else 0.0
    activations = activations_fp32 if precision == "no" else activations_low
    return Estimate(
        label,
        strategy,
        ranks,
        params,
        weights,
        gradients,
        optimizer,
        activations,
        buffers,
        step_temporary=trained * weight_b / (ranks if shard[0] and ranks > 1 else 1),
        per_parameter=per_parameter,
        timing_buffers=timing,
    )


def precision_rows(
    backends: dict[str, dict[str, float]], precisions: list[str]
) -> list[tuple[str, str, tuple[float, float, float], float | None]]:
    """(label, precision, bytes per parameter, bytes per frozen-base weight or None) for each
    precision asked; one row per backend for fp8 (and fp4) from what each backend declares
    (``frozen_linear``: a frozen base's weight stored its own way), plus its low-bit optimizer
    states when it has them."""
    rows = []
    for precision in precisions:
        if precision in NATIVE_BYTES:
            rows.append((precision if precision != "no" else "fp32", precision, NATIVE_BYTES[precision], None))
            continue
        for name, memory in backends.items():
            per = (memory.get("weights", 4.0), memory.get("gradients", 4.0), memory.get("optimizer", 8.0))
            frozen = memory.get("frozen_linear")
            rows.append((f"{precision} ({name})", precision, per, frozen))
            if "optimizer_low_bit" in memory:
                rows.append(
                    (
                        f"{precision} ({name}) + low-bit Adam states",
                        precision,
                        (per[0], per[1], memory["optimizer_low_bit"]),
                        frozen,
                    )
                )
    return rows


def _span(low: float, high: float) -> str:
    """``12.0`` or, when timing decides, ``12.0-76.0`` (MB)."""
    return f"{low / MB:.1f}" if high == low else f"{low / MB:.1f}-{high / MB:.1f}"


def table(estimates: list[Estimate]) -> str:
    head = (
        f"{'precision':<34} {'strategy':<9} {'B/param w+g+o':>14} {'weights':>9} {'grads':>9} {'optim':>9} "
        f"{'activ.':>9} {'buffers':>13} {'peak MB':>13}"
    )
    lines = [head, "-" * len(head)]
    for e in estimates:
        per = "+".join(f"{b:g}" for b in e.per_parameter)
        lines.append(
            f"{e.label:<34} {e.strategy + (f'x{e.ranks}' if e.ranks > 1 else ''):<9} {per:>14} "
            f"{e.weights / MB:>9.1f} {e.gradients / MB:>9.1f} {e.optimizer / MB:>9.1f} {e.activations / MB:>9.1f} "
            f"{_span(e.buffers, e.buffers + e.timing_buffers):>13} {_span(e.peak_low, e.peak):>13}"
        )
    return "\n".join(lines)


def estimate_all(
    spec: str,
    precisions: list[str],
    strategies: dict[str, StrategyMemory],
    ranks: int,
    batch_size: int,
    seq_len: int,
    backends: dict[str, dict[str, float]],
    model_factory: Callable[[str], nn.Module] = load_model_on_meta,
) -> list[Estimate]:
    model = model_factory(spec)
    inputs = example_inputs(model, batch_size, seq_len)
    fp32 = saved_activation_bytes(model, inputs, low_precision_linears=False)
    low = saved_activation_bytes(model, inputs, low_precision_linears=True)
    out = []
    for label, precision, per, frozen in precision_rows(backends, precisions):
        for strategy, memory in strategies.items():
            out.append(estimate(model, precision, strategy, memory, ranks, fp32, low, per, label, frozen))
    return out
