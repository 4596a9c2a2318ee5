"""One rank of test_failing_ranks.py's jobs. At step 3 rank RANK fails while the other waits in
DDP's all-reduce, and first writes the time of that moment to STAMP:

    lowbit launch --cpu --num_processes 2 tests/distributed/failing_rank_worker.py raise|stuck RANK STAMP

``raise``: it raises ValueError. ``stuck``: it loops forever and never reaches the next all-reduce
(the process group's timeout is 15 s here, InitProcessGroupKwargs, so the job must end soon after;
long enough for two ranks started on a busy machine to meet, short enough not to idle a CI worker).
"""

import datetime
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator
from lowbit.utils import InitProcessGroupKwargs


def main(how: str, fail_rank: int, stamp: Path) -> None:
    handlers = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=15))] if how == "stuck" else []
    accelerator = Accelerator(kwargs_handlers=handlers)
    model = nn.Linear(8, 8)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(1000):
        if step == 3 and accelerator.process_index == fail_rank:
            stamp.write_text(str(time.time()))
            if how == "raise":
                raise ValueError("rank failed on purpose")
            while True:
                time.sleep(1)
        accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
