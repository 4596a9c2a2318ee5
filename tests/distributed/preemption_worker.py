"""A training loop that saves when the job is preempted (``accelerator.on_preemption``); for
``tests/core/training/test_preemption.py``. Writes its pid, then trains until SIGTERM arrives."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
model = nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = accelerator.prepare(model, optimizer)
steps = {"done": 0}
accelerator.on_preemption(lambda: (accelerator.save_state(out / "ckpt"),
                                   (out / f"saved_at_{accelerator.process_index}").write_text(str(steps["done"]))))
(out / f"pid_{accelerator.process_index}").write_text(str(os.getpid()))
for step in range(100000):
    accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    steps["done"] = step + 1
    if step == 3:
        (out / f"training_{accelerator.process_index}").write_text("yes")
    time.sleep(0.02)
