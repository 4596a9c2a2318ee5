"""A short training run under Hugging Face Accelerate itself, ending in its own ``save_state``
(test_accelerate_checkpoint.py resumes it under lowbit).

    python tests/scripts/accelerate_save_state.py OUT safetensors|bin

Writes OUT/ckpt (Accelerate's checkpoint) and OUT/reference.pt (what a resume must restore).
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import Counter  # noqa: E402 - the checkpointable object the lowbit side registers too


def main(out: str, safe: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    accelerator = Accelerator(cpu=True)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.n += len(x)
    accelerator.save_state(out + "/ckpt", safe_serialization=safe)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "seen": counter.n,
            "step": accelerator.step,
            "next_random": torch.rand(3),
        },
        out + "/reference.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "safetensors")
