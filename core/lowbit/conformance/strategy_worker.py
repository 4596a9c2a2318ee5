"""One run of the strategy conformance kit: ``python -m lowbit.conformance.strategy_worker OUT [--reference]``.

Started by :func:`lowbit.conformance.run_strategy_conformance`, under ``lowbit launch`` with the
strategy under test (every rank trains its share of each global batch), or alone with
``--reference`` (one process trains on the whole global batch). Each rank writes
``OUT/rank<i>.json``: the strategy in use, the loss of every step averaged over the ranks, the
model's full state as numbers, and the losses of a second model resumed from a checkpoint taken
mid-way. The reference writes ``OUT/reference.json`` the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

STEPS, SAVE_AFTER, GLOBAL_BATCH, LR = 6, 3, 16, 1e-2


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * x[:, 4:8]


def train(acc, model, optimizer, steps: range) -> list[float]:
    """Each rank trains on its contiguous share of every global batch (the reference on all of it)."""
    losses = []
    for step in steps:
        x, y = global_batch(step)
        x, y = x.chunk(acc.num_processes)[acc.process_index], y.chunk(acc.num_processes)[acc.process_index]
        loss = nn.functional.mse_loss(model(x.to(acc.device)), y.to(acc.device))
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(acc.gather(loss.detach().reshape(1)).mean().item())
    return losses


def prepared():
    from lowbit import Accelerator

    acc = Accelerator()
    model = build_model()
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return acc, model, optimizer


def main(out: Path, reference: bool) -> None:
    acc, model, optimizer = prepared()
    losses = train(acc, model, optimizer, range(SAVE_AFTER))
    acc.save_state(out / "checkpoint")
    losses += train(acc, model, optimizer, range(SAVE_AFTER, STEPS))
    state = {k: v.float().flatten().tolist() for k, v in acc.get_state_dict(model).items()}
    resumed_acc, resumed, resumed_optimizer = prepared()
    resumed_acc.load_state(out / "checkpoint")
    resumed_losses = train(resumed_acc, resumed, resumed_optimizer, range(SAVE_AFTER, STEPS))
    result = {
        "strategy": acc.distributed_strategy,
        "distributed_type": str(getattr(acc.distributed_type, "value", acc.distributed_type)),
        "world_size": acc.num_processes,
        "losses": losses,
        "resumed_losses": resumed_losses,
        "state": state,
    }
    name = "reference.json" if reference else f"rank{acc.process_index}.json"
    (out / name).write_text(json.dumps(result))
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--reference" in sys.argv[2:])
