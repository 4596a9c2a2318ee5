"""torch.compile of a prepared model under a launched strategy: each rank trains each precision
named on the command line (one Accelerator each), and the same model wrapped by torch itself (DDP,
or fully_shard under --use_fsdp) in a plain bf16 loop, and writes what dynamo compiled for each.

    lowbit launch --cpu --num_processes 2 [--use_fsdp] compile_worker.py OUT_DIR no,bf16,fp8-tensorwise
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator


def accelerator_for(precision: str) -> Accelerator:
    if precision.startswith("fp8"):
        from lowbit.utils import AORecipeKwargs

        # every layer in FP8, no float8 all-gather (an FSDP2 gather in float8 is its own test)
        options = AORecipeKwargs(
            recipe=precision.split("-")[1], keep_first_last_high_precision=False, enable_fsdp_float8_all_gather=False
        )
        return Accelerator(mixed_precision="fp8", kwargs_handlers=[options])
    return Accelerator(mixed_precision=precision)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def train_loop(batches, forward, backward, optimizer, after_first_step) -> list[float]:
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(forward(x).float(), y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == 1:
            after_first_step()
    return losses


def counted(train) -> dict:
    """What dynamo compiled over ``train(after_first_step)``: graphs after the first step and at the end, breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    first: list[int] = []
    losses = train(lambda: first.append(counters["stats"]["unique_graphs"]))
    return {
        "graphs_after_first_step": first[0],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "steps": len(losses),
        "finite": all(loss == loss for loss in losses),
    }


def lowbit_run(precision: str):
    def train(after_first_step) -> list[float]:
        accelerator = accelerator_for(precision)
        data = [(torch.randn(32), torch.randn(16)) for _ in range(16 * 11 * accelerator.num_processes)]
        loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
        model = make_model()
        model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2), loader)
        compiled = torch.compile(model, backend="aot_eager")
        return train_loop(loader, compiled, accelerator.backward, optimizer, after_first_step)

    return train


def torch_run(sharded: bool):
    """The same model, wrapped by torch itself and compiled the same way, in a hand-written bf16 loop."""

    def train(after_first_step) -> list[float]:
        model = make_model()
        if sharded:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            wrapped = model
        else:
            wrapped = nn.parallel.DistributedDataParallel(model)
        compiled = torch.compile(wrapped, backend="aot_eager")

        def forward(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return compiled(x)

        batches = [(torch.randn(16, 32), torch.randn(16, 16)) for _ in range(11)]
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        return train_loop(batches, forward, lambda loss: loss.backward(), optimizer, after_first_step)

    return train


def main() -> None:
    out, precisions = Path(sys.argv[1]), sys.argv[2].split(",")
    results = {precision: counted(lowbit_run(precision)) for precision in precisions}
    accelerator = Accelerator()
    results["torch"] = counted(torch_run(accelerator.distributed_type.value == "FSDP"))
    results["strategy"] = accelerator.distributed_type.value
    (out / f"result_rank{accelerator.process_index}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
