"""One rank of a job that ``lowbit launch`` started on a "cluster" (tests/core/cli/test_cluster_launch.py):
it says which process of how many it is, on which machine, and the sum of an all-reduce over
every process, as one JSON line. A job split into independent ones shows ``of 1`` and a sum of 1.

    lowbit launch ... tests/distributed/cluster_worker.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

from lowbit import Accelerator


def main() -> None:
    accelerator = Accelerator()
    mine = torch.tensor([accelerator.process_index + 1.0], device=accelerator.device)
    total = accelerator.reduce(mine, reduction="sum")
    facts = {
        "process": accelerator.process_index,
        "of": accelerator.num_processes,
        "machine": int(os.environ.get("GROUP_RANK", "0")),
        "sum": float(total.item()),
    }
    sys.stdout.write("CLUSTER " + json.dumps(facts) + "\n")  # one write: lines of two ranks never interleave
    sys.stdout.flush()
    accelerator.end_training()


if __name__ == "__main__":
    main()
