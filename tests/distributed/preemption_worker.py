"""A training loop that saves when the job is preempted (``accelerator.on_preemption``); for
``tests/core/training/test_preemption.py``. Writes its pid, then trains until SIGTERM arrives.
With a second argument N, its batches come from a prepared DataLoader with N worker processes
(which the scheduler's SIGTERM reaches too)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator

out = Path(sys.argv[1])
loader_workers = int(sys.argv[2]) if len(sys.argv) > 2 else 0
accelerator = Accelerator(cpu=True)
model = nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = torch.utils.data.DataLoader(torch.randn(400000, 8), batch_size=4, num_workers=loader_workers)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
steps = {"done": 0}
accelerator.on_preemption(
    lambda: (
        accelerator.save_state(out / "ckpt"),
        (out / f"saved_at_{accelerator.process_index}").write_text(str(steps["done"])),
    )
)
(out / f"pid_{accelerator.process_index}").write_text(str(os.getpid()))
for step, batch in enumerate(loader):
    accelerator.backward(model(batch if loader_workers else torch.randn(4, 8)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    steps["done"] = step + 1
    # Read on the main process alone, as scripts write it: it must need nothing of the others (each
    # read was an all-reduce made by rank 0 alone: the job hung).
    if accelerator.is_main_process and accelerator.preemption_requested:
        (out / "main_saw_the_request").write_text(str(steps["done"]))
    if step == 3:
        (out / f"training_{accelerator.process_index}").write_text("yes")
    time.sleep(0.02)
