"""Two processes that start their process group themselves, with no RANK or WORLD_SIZE variables
(as Accelerate's debug_launcher, or a script's own init_process_group): for tests/core/builtin/test_distributed.py.
Each rank writes what its Accelerator says about it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    from lowbit import Accelerator

    accelerator = Accelerator(cpu=True)
    facts = {
        "process_index": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "is_main_process": accelerator.is_main_process,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    mp.spawn(run, args=(2, sys.argv[1]), nprocs=2)
