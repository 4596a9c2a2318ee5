"""Kill-and-resume at every step, each against an uninterrupted run, in one process group (1 or
2 processes): for tests/core/checkpoint/test_exact_resume.py. Writes, per variant and step k, the
largest difference between the resumed run's final weights and the uninterrupted run's.

    lowbit launch --cpu --num_processes N resume_worker.py VARIANT[,...] OUT_DIR

writes OUT_DIR/VARIANT/resume_rank<r>.json: {k: max |diff|}."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator, skip_first_batches
from lowbit.utils import set_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import run_scenarios  # noqa: E402

EPOCHS, SAMPLES, BATCH = 3, 40, 4
# How the data is drawn and stepped: "shuffle" (a shuffling DataLoader), "accumulate" (2 micro-steps
# per optimizer step), "batch_sampler" (a BatchSampler over a RandomSampler), "iterable" (an
# IterableDataset that shuffles each epoch from the global RNG), "fp8" (shuffle, in fp8 with lowbit-ao),
# "seedable" (shuffle with use_seedable_sampler: each epoch's order from seed + epoch).
VARIANTS = ("shuffle", "accumulate", "batch_sampler", "iterable", "fp8", "seedable")


def stop_steps(variant: str, world: int) -> list[int]:
    """Where the run is killed: after every optimizer step but the last (every other micro-step when
    accumulating)."""
    every = 2 if variant == "accumulate" else 1
    return list(range(every, EPOCHS * SAMPLES // (BATCH * world), every))


class ShuffledStream(torch.utils.data.IterableDataset):
    """40 samples in an order drawn from the global RNG at each epoch's start."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        for i in torch.randperm(len(self.x)).tolist():
            yield self.x[i], self.y[i]


def build(variant: str):
    set_seed(0)
    from lowbit.utils import DataLoaderConfiguration

    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2 if variant == "accumulate" else 1,
        mixed_precision="fp8" if variant == "fp8" else None,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=variant == "seedable"),
    )
    width = 32 if variant != "fp8" else 64  # fp8: a middle Linear with dims divisible by 16 to convert
    model = nn.Sequential(
        nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    if variant == "batch_sampler":
        sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), BATCH, drop_last=False)
        loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    elif variant == "iterable":
        loader = torch.utils.data.DataLoader(ShuffledStream(x, y), batch_size=BATCH)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def train(variant, accelerator, model, optimizer, loader, scheduler, start: int = 0, stop: int | None = None) -> int:
    """Train from global step ``start`` (resuming mid-epoch as Accelerate's examples do) to ``stop``,
    returning inside the loop right after step ``stop`` as a script that saves there does: at an
    epoch's last step the loader has handed out its last batch but the epoch's loop has not ended."""
    # a stream has no length: its batches are dispatched, one per process per step (as in Accelerate)
    per_epoch = -(-SAMPLES // (BATCH * accelerator.num_processes)) if variant == "iterable" else len(loader)
    step = start
    for epoch in range(start // per_epoch, EPOCHS):
        skip = start % per_epoch if epoch == start // per_epoch else 0
        for x, y in skip_first_batches(loader, skip) if skip else loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step += 1
            if step == stop:
                return step
    return step


def kill_and_resume(variant: str, out: Path) -> None:
    acc, model, opt, loader, sched = build(variant)
    train(variant, acc, model, opt, loader, sched)
    reference = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    results = {}
    for k in stop_steps(variant, int(os.environ.get("WORLD_SIZE", "1"))):
        acc, model, opt, loader, sched = build(variant)
        train(variant, acc, model, opt, loader, sched, stop=k)
        acc.save_state(out / f"ckpt_{k}")
        acc, model, opt, loader, sched = build(variant)  # a new run: fresh objects, other weights until load_state
        acc.load_state(out / f"ckpt_{k}")
        train(variant, acc, model, opt, loader, sched, start=k)
        final = acc.unwrap_model(model).state_dict()
        results[k] = max((final[n] - reference[n]).abs().max().item() for n in reference)
    (out / f"resume_rank{acc.process_index}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_scenarios(kill_and_resume)
