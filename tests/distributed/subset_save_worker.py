"""save_state called on the main process only (a common mistake): for tests/test_failing_ranks.py."""

from __future__ import annotations

import sys

import torch
from torch import nn

from lowbit import Accelerator

accelerator = Accelerator(cpu=True)  # torch's default process-group timeout: 30 minutes on gloo
model, optimizer = accelerator.prepare(nn.Linear(4, 4), torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1))
if accelerator.is_main_process:
    accelerator.save_state(sys.argv[1])
for _ in range(1000):  # the other rank trains on, into an all-reduce the main process never joins
    accelerator.backward(model(torch.randn(2, 4)).sum())
