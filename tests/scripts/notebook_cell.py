"""A notebook cell's code, run as ``python - < notebook_cell.py OUT_DIR`` so that, as in a notebook,
``__main__`` has no file a new process could import it from: the launchers must fork (a spawned
process cannot find ``cell_function``). For tests/core/training/test_multi_gpu_rules.py."""

import json
import sys
from pathlib import Path

import torch

from lowbit import Accelerator, debug_launcher, notebook_launcher

OUT = Path(sys.argv[1])


def cell_function(tag):
    accelerator = Accelerator(cpu=True)
    total = accelerator.reduce(torch.ones(1), "sum").item()
    (OUT / f"{tag}{accelerator.process_index}.json").write_text(
        json.dumps({"processes": accelerator.num_processes, "sum": total})
    )


notebook_launcher(cell_function, ("notebook",), num_processes=2)
debug_launcher(cell_function, ("debug",), num_processes=2)
