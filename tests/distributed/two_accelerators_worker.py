"""A loader prepared by one Accelerator, gathered by another (Accelerate's fp8 benchmarks do it)."""
import json
import sys

import torch

from lowbit import Accelerator

first, second = Accelerator(cpu=True), Accelerator(cpu=True)
loader = first.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(21.0)), batch_size=4))
seen = [v for (x,) in loader for v in second.gather_for_metrics(x).tolist()]
if second.is_main_process:
    open(sys.argv[1], "w").write(json.dumps(seen))
