"""Bytes per parameter of weights, gradients and optimizer state, after a real training step.

    python bench/memory.py

Counted from the tensors themselves (torchao's FP8 optimizer states count their scales too).
"""

from __future__ import annotations

import warnings

import torch
from common import batch, make_model, print_table, step_fn

from lowbit import Accelerator
from lowbit.utils import AORecipeKwargs

warnings.filterwarnings("ignore")


def tensor_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "__tensor_flatten__"):  # a tensor subclass: count what it is made of
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def measure(precision: str, handlers: list) -> tuple[float, float, float]:
    acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    step_fn(model, opt, *batch(), backward=acc.backward)()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    weights = sum(tensor_bytes(p.detach()) for p in params) / n
    grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None) / n
    state = (
        sum(tensor_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0) / n
    )
    return weights, grads, state


def main() -> None:
    setups = [
        ("fp32 AdamW", "no", []),
        ("bf16 autocast", "bf16", []),
        ("fp8 (ao)", "fp8", [AORecipeKwargs()]),
        ("fp8 (ao) + FP8 Adam states", "fp8", [AORecipeKwargs(optimizer_states="fp8")]),
    ]
    rows = []
    for label, precision, handlers in setups:
        weights, grads, state = measure(precision, handlers)
        rows.append((label, weights, grads, state, weights + grads + state))
    print_table(
        "bytes per parameter (weights kept in fp32 by every setup: master weights)",
        ("setup", "weights", "grads", "optimizer state", "total"),
        rows,
    )


if __name__ == "__main__":
    main()
