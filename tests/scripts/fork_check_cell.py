"""A notebook cell run as ``python - < fork_check_cell.py OUT_DIR``: notebook_launcher forks, and each
child says whether torch marks it a "bad fork" (CUDA touched in the parent before the fork: the
child dies when it uses a GPU). For tests/core/training/test_launchers.py."""

import json
import sys
from pathlib import Path

import torch

from lowbit import notebook_launcher

OUT = Path(sys.argv[1])


def cell_function():
    import os

    bad = torch.cuda._is_in_bad_fork()  # first, before this child does anything with torch.cuda
    (OUT / f"rank{os.environ['RANK']}.json").write_text(json.dumps({"bad_fork": bad}))


notebook_launcher(cell_function, num_processes=2)
