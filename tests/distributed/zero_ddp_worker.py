"""One rank of test_third_party_strategy.py: one AdamW step under whatever strategy the launcher
chose (examples/third_party_strategy's zero_ddp), then OUT/rank<N>.json says which strategy ran and
how much optimizer state this rank holds (sharded: a part of the model's).

    lowbit launch --cpu --num_processes 2 --use_zero_ddp tests/distributed/zero_ddp_worker.py OUT
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator


def main(out: Path) -> None:
    acc = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loss = model(torch.randn(8, 16)).pow(2).mean()
    acc.backward(loss)
    optimizer.step()
    inner = optimizer.optimizer
    local = sum(v.numel() for s in inner.optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    (out / f"rank{acc.process_index}.json").write_text(
        json.dumps(
            {
                "rank": acc.process_index,
                "strategy": acc.distributed_strategy,
                "type": str(acc.distributed_type.value),
                "optimizer": type(inner).__name__,
                "local_state": local,
                "params": sum(p.numel() for p in model.parameters()),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
