"""SIGTERM while a rank is joined (``join_uneven_inputs``' tail): rank 1 trains 4 steps and joins,
rank 0 trains on; for ``tests/core/training/test_preemption.py``. Both save through
``on_preemption`` and exit 143: the joined rank takes part in the save from its shadow of the step.

    lowbit launch --cpu --num_processes 2 tests/distributed/preemption_join_worker.py OUT
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator

out = Path(sys.argv[1])
os.environ["LOWBIT_PREEMPTION_POLL_STEPS"] = "1"
accelerator = Accelerator(cpu=True)
model = nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = accelerator.prepare(model, optimizer)
rank = accelerator.process_index
accelerator.on_preemption(lambda: (accelerator.save_state(out / "ckpt"), (out / f"saved_{rank}").write_text("yes")))
(out / f"pid_{rank}").write_text(str(os.getpid()))
steps = 100000 if rank == 0 else 4
with accelerator.join_uneven_inputs([model], even_batches=False):
    for step in range(steps):
        accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and step == 20:  # rank 1 joined long ago
            (out / "rank1_joined").write_text("yes")
        time.sleep(0.02)
(out / f"finished_{rank}").write_text("no preemption came")
