"""The loop from Accelerate's low-precision docs, with `accelerate` replaced by `lowbit`.

    python examples/fp8_train.py                                                        # one device
    lowbit launch --config_file examples/configs/ddp.yaml examples/fp8_train.py         # DDP, 2 processes
    lowbit launch --config_file examples/configs/fsdp.yaml examples/fp8_train.py        # FSDP2, float8 all-gather
    lowbit launch --config_file examples/configs/deepspeed_zero2.yaml examples/fp8_train.py

The script asks for fp8; the backend and the strategy come from the config (or --fp8_backend,
--use_fsdp, ...), and prepare() prints which Linear layers train in FP8. Nothing in
the script changes between one device and many.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit import Accelerator


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def make_model(width: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(32, width), *[Block(width) for _ in range(2)], nn.Linear(width, 8))


def main() -> None:
    accelerator = Accelerator(mixed_precision="fp8")  # backend and strategy: from the config file / launcher
    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = torch.tanh(x @ torch.randn(32, 8))
    dataset = torch.utils.data.TensorDataset(x, y)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3 * len(dataloader))

    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    accelerator.print(
        f"precision={accelerator.mixed_precision} fp8_backend={accelerator.fp8_backend} "
        f"strategy={accelerator.distributed_strategy} processes={accelerator.num_processes}"
    )
    for epoch in range(3):
        total = 0.0
        for inputs, targets in dataloader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            total += loss.item()
        mean = accelerator.gather(torch.tensor([total / len(dataloader)])).mean().item()
        accelerator.print(f"epoch {epoch}: loss {mean:.4f}")
    accelerator.save_model(model, "runs/fp8_train")
    accelerator.print("saved runs/fp8_train/model.safetensors (loads into the plain model)")


if __name__ == "__main__":
    main()
