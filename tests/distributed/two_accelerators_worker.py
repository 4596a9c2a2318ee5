"""A loader prepared by one Accelerator, gathered by another (Accelerate's fp8 benchmarks do it),
with and without drop_last (their eval loaders drop the last batch)."""

import json
import sys

import torch

from lowbit import Accelerator

first, second = Accelerator(cpu=True), Accelerator(cpu=True)
seen = {}
for drop_last in (False, True):
    loader = first.prepare(
        torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.arange(21.0)), batch_size=4, drop_last=drop_last
        )
    )
    seen[str(drop_last)] = [v for (x,) in loader for v in second.gather_for_metrics(x).tolist()]
if second.is_main_process:
    open(sys.argv[1], "w").write(json.dumps(seen))
