"""Gradients are averaged across processes on the steps that sync and left alone inside
``no_sync`` and between ``accumulate`` boundaries. ``python -m lowbit.test_utils.scripts.test_sync``
under a launcher (on one process it checks the bookkeeping: nothing to average)."""

from __future__ import annotations

import torch

from lowbit import Accelerator
from lowbit.test_utils.training import RegressionModel

from lowbit.compat.utils import gather


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.stack([p.grad.detach().clone().reshape(()) for p in model.parameters()])


def _same_on_every_process(values: torch.Tensor) -> bool:
    everyone = gather(values[None])
    return bool(torch.allclose(everyone, everyone[:1].expand_as(everyone)))


def _backward(accelerator: Accelerator, model: torch.nn.Module) -> None:
    x = torch.full((4,), float(accelerator.process_index + 1), device=accelerator.device)
    accelerator.backward((model(x) - 1).pow(2).mean())


def check_no_sync(accelerator: Accelerator) -> None:
    model = accelerator.prepare(RegressionModel(a=1, b=1))
    with accelerator.no_sync(model):
        _backward(accelerator, model)
    local = _grads(model)
    if accelerator.num_processes > 1 and _same_on_every_process(local):
        raise AssertionError("inside no_sync the gradients were averaged across processes")
    model.zero_grad()
    _backward(accelerator, model)
    if not _same_on_every_process(_grads(model)):
        raise AssertionError("outside no_sync the gradients differ between processes")


def check_accumulate(accelerator: Accelerator) -> None:
    accelerator.gradient_accumulation_steps = 2
    model = accelerator.prepare(RegressionModel(a=1, b=1))
    syncs = []
    for _ in range(4):
        with accelerator.accumulate(model):
            _backward(accelerator, model)
            syncs.append(accelerator.sync_gradients)
            if accelerator.sync_gradients:
                if not _same_on_every_process(_grads(model)):
                    raise AssertionError("at an accumulation boundary the gradients differ between processes")
                model.zero_grad()
    if syncs != [False, True, False, True]:
        raise AssertionError(f"with 2 accumulation steps sync_gradients went {syncs}, not [False, True, False, True]")


def main() -> None:
    check_no_sync(Accelerator())
    check_accumulate(Accelerator())
    Accelerator().print("test_sync: no_sync and accumulate checked")


if __name__ == "__main__":
    main()
