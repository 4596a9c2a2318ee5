"""A training loop that checkpoints on a scheduler's early warning (SIGUSR1, as Slurm's
``--signal=USR1@90``) and trains on; for ``tests/core/training/test_preemption.py``.

    lowbit launch --cpu --num_processes 2 tests/distributed/preemption_warning_worker.py OUT [signal]

With ``signal``, rank 0 sends SIGUSR1 to the launcher (its nearest ``lowbit launch`` ancestor)
after step 3. Each rank writes its losses, and the step at which its checkpoint was written.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator

STEPS = 16
out = Path(sys.argv[1])
send_warning = len(sys.argv) > 2
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.utils.data.TensorDataset(torch.randn(STEPS * 8, 8), torch.randn(STEPS * 8, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
state = {"step": 0, "saved_at": []}
accelerator.on_preemption(
    lambda: (accelerator.save_state(out / f"ckpt_{state['step']}"), state["saved_at"].append(state["step"]))
)


received = []
lowbits_handler = signal.getsignal(signal.SIGUSR1)  # installed by on_preemption


def seen(signum, frame):  # the warning reached this rank through the launcher
    received.append(signum)
    lowbits_handler(signum, frame)


signal.signal(signal.SIGUSR1, seen)


def launcher_pid() -> int:
    """The nearest ancestor running ``lowbit launch`` (torchrun's parent; further up when a
    --no_python wrapper runs this script as its child)."""
    pid = os.getppid()
    while pid > 1:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"lowbit.cli.main" in command and b"launch" in command:
            return pid
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    raise RuntimeError("no lowbit launch above this process")


losses = []
for x, y in loader:
    loss = nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    state["step"] += 1
    if send_warning and state["step"] == 3 and accelerator.is_main_process:
        os.kill(launcher_pid(), signal.SIGUSR1)
        for _ in range(3000):  # the launcher forwards it within moments; the next poll is at step 4
            if received:
                break
            time.sleep(0.01)
(out / f"rank{accelerator.process_index}.json").write_text(json.dumps({"losses": losses, **state}))
