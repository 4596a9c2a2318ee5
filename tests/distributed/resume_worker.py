"""Kill-and-resume at given steps, each against an uninterrupted run, in one process group (1 or
2 processes): for tests/test_exact_resume.py. Writes, per step k, whether the resumed run ended on
bit-identical weights."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator
from lowbit import skip_first_batches
from lowbit.utils import set_seed

EPOCHS, BATCH = 3, 4


def build():
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def train(accelerator, model, optimizer, loader, scheduler, start: int = 0, stop: int | None = None) -> int:
    """Train from global step ``start`` (resuming mid-epoch as Accelerate's examples do) to ``stop``."""
    per_epoch = len(loader)
    step = start
    for epoch in range(start // per_epoch, EPOCHS):
        batches = skip_first_batches(loader, start % per_epoch) if epoch == start // per_epoch else loader
        for x, y in batches:
            if stop is not None and step == stop:
                return step
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
    return step


def main() -> None:
    out, stops = Path(sys.argv[1]), [int(k) for k in sys.argv[2].split(",")]
    acc, model, opt, loader, sched = build()
    train(acc, model, opt, loader, sched)
    reference = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    results = {}
    for k in stops:
        acc, model, opt, loader, sched = build()
        train(acc, model, opt, loader, sched, stop=k)
        acc.save_state(out / f"ckpt_{k}")
        acc, model, opt, loader, sched = build()  # a new run: fresh objects, other weights until load_state
        acc.load_state(out / f"ckpt_{k}")
        train(acc, model, opt, loader, sched, start=k)
        final = acc.unwrap_model(model).state_dict()
        results[k] = max((final[n] - reference[n]).abs().max().item() for n in reference)
    (out / f"resume_rank{acc.process_index}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
