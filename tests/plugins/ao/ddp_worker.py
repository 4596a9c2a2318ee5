"""One rank of lowbit-ao under DDP, launched by ``lowbit launch`` (test_ao.py on CPU, test_ao_gpu.py on
CUDA): fp8 with odd token counts (3 x 11 = 33 tokens, padded for the FP8 GEMMs), five AdamW steps.

    python -m lowbit.cli.main launch --cpu --num_processes 2 --mixed_precision fp8 tests/plugins/ao/ddp_worker.py

Prints one JSON line: the strategy, the losses and the FP8 report. The device is the Accelerator's
(``--cpu`` or a GPU), so the same script runs in CPU CI and on a GPU.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from lowbit import Accelerator
from lowbit.utils import AORecipeKwargs


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.Linear(256, 256)
    )
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(3, 11, 256, device=accelerator.device)
    losses = []
    for _ in range(5):
        loss = model(x).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if accelerator.is_main_process:
        print(
            json.dumps(
                {
                    "strategy": accelerator._run.context.strategy,
                    "device": accelerator.device.type,
                    "losses": losses,
                    "report": accelerator.fp8_report(),
                }
            )
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
