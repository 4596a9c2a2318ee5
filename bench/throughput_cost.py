"""What the throughput meter costs: lowbit's training step with it / without it (LOWBIT_THROUGHPUT=0).

    python bench/throughput_cost.py

Both loops are lowbit's, on the benchmark model, each reading its batches from a prepared
dataloader (the meter counts every batch and times the wait for it, and reads the clock and the
peak memory at every optimizer step); steps run in adjacent pairs, the median of the pair ratios
is reported. The first step of each (where the FLOPs are counted once) is in the warm-up.
"""

from __future__ import annotations

import os
import warnings

import torch
from common import batch, compare, make_model, print_table
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")


def metered_loop(precision: str, meter: bool):
    from lowbit import Accelerator

    os.environ["LOWBIT_THROUGHPUT"] = "1" if meter else "0"
    os.environ["LOWBIT_THROUGHPUT_EVERY"] = "0"
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    model = make_model()
    x, y = batch()
    loader = DataLoader(TensorDataset(x.repeat(8, 1), y.repeat(8, 1)), batch_size=x.shape[0])
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), loader)

    def batches():
        while True:
            yield from loader

    stream = batches()

    def step() -> None:
        inputs, targets = next(stream)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step


def main() -> None:
    rows = []
    for precision in ("no", "bf16"):
        on_s, off_s, ratio = compare(metered_loop(precision, True), metered_loop(precision, False), pairs=150)
        rows.append((precision, on_s * 1000, off_s * 1000, ratio))
    print_table(
        "Throughput meter: step time with / without (median of pair ratios)",
        ("precision", "with ms", "without ms", "ratio"),
        rows,
    )


if __name__ == "__main__":
    main()
