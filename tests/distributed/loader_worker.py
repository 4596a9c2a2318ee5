"""A shuffled DataLoader with the user's loading settings, prepared for several processes and read
for one epoch; each rank writes what it saw. For tests/core/training/test_multi_gpu_rules.py.

    lowbit launch --cpu --num_processes 2 [--use_fsdp] loader_worker.py SCENARIO[,...] OUT_DIR

Several scenarios (comma-separated) run in turn in one launch, each with an Accelerator of its
own; rank R of each writes OUT_DIR/SCENARIO/rankR.json.

SCENARIO: ``workers`` (num_workers=2, pin_memory, persistent workers, a worker_init_fn),
``hop-reverted`` (the shuffle order's broadcast without the device hop: what item 1 of #46 was),
``user-gather`` (a script gathers and reduces CPU tensors of its own), ``train`` (a model trained
from the shuffled loader in workers, under the launch's strategy), ``hop`` (where the device hop puts
a generator's state, and whether the group takes a host tensor as it is: NCCL does not),
``dispatch-strings`` (dispatch_batches with batches that hold a list of names beside the ids, with and
without split_batches: each rank records the (id, name) pairs it got), ``nccl-rules`` (reduces of
shapes that differ between ranks, of an int16 and of a transposed tensor, under the simulated rule).
The GPU tests (test_multi_gpu_rules_gpu.py) run ``train`` and ``hop`` on one GPU over NCCL.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from lowbit import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import run_scenarios  # noqa: E402

LENGTH = 32


class WhoLoads(Dataset):
    """Item i: (i, the pid of the process that read it)."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int):
        return torch.tensor(index), torch.tensor(os.getpid())


def mark_worker(worker_id: int) -> None:
    os.environ["LOADER_WORKER_STARTED"] = str(worker_id)


def train(accelerator: Accelerator, result: dict) -> None:
    torch.manual_seed(0)
    table = torch.randn(LENGTH, 8)
    model = torch.nn.Linear(8, 1)
    loader = DataLoader(WhoLoads(), batch_size=4, shuffle=True, num_workers=2, pin_memory=True)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), loader)
    losses, pids, devices = [], set(), set()
    for _ in range(4):
        for indices, loaded_by in loader:
            x = table[indices.cpu()].to(accelerator.device)
            loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
            pids |= set(loaded_by.tolist())
            devices.add(indices.device.type)
    result.update(
        strategy=accelerator._run.context.strategy,
        losses=losses,
        loader_pids=sorted(pids),
        batch_devices=sorted(devices),
        device=accelerator.device.type,
    )


def hop(result: dict) -> None:
    import torch.distributed as dist

    from lowbit.runtime.collective_device import on_group_device

    state = torch.Generator().manual_seed(1).get_state()
    moved = on_group_device(state, copy=True)
    dist.broadcast(moved, src=0)
    result.update(backend=dist.get_backend(), hop_device=moved.device.type, back_equal=torch.equal(moved.cpu(), state))
    try:
        dist.broadcast(state.clone(), src=0)  # this script's own collective: never checked by the simulation
        result["host_tensor_taken"] = True
    except RuntimeError as error:
        result["host_tensor_taken"] = False
        result["host_tensor_error"] = str(error)[:300]


def run(scenario: str, out: Path) -> None:
    accelerator = Accelerator()
    result: dict = {"pid": os.getpid()}
    if scenario == "hop-reverted":
        import lowbit.runtime.training.operations as operations

        operations.on_group_device = lambda tensor, copy=False: tensor.clone() if copy else tensor
    if scenario == "train":
        train(accelerator, result)
    elif scenario == "hop":
        hop(result)
    elif scenario == "dispatch-strings":
        from lowbit.utils import DataLoaderConfiguration

        class Named(Dataset):
            def __len__(self) -> int:
                return 22  # not a multiple of 4: the last global batch is completed with the first samples

            def __getitem__(self, index: int):
                return {"id": torch.tensor(index), "name": f"s{index}"}

        for split in (True, False):
            accelerator = Accelerator(
                dataloader_config=DataLoaderConfiguration(dispatch_batches=True, split_batches=split)
            )
            loader = accelerator.prepare(DataLoader(Named(), batch_size=4))
            result[f"split={split}"] = [list(zip(batch["id"].tolist(), batch["name"])) for batch in loader]
    elif scenario == "nccl-rules":
        rank = accelerator.process_index
        cases = {
            "shapes": lambda: accelerator.reduce(torch.ones(2 + rank), "sum"),
            "int16": lambda: accelerator.reduce(torch.ones(2, dtype=torch.int16), "sum"),
            "transposed": lambda: accelerator.reduce(torch.arange(6.0).reshape(2, 3).t(), "sum").tolist(),
        }
        for case, run in cases.items():
            try:
                result[case] = run() if case == "transposed" else str(run().tolist())
            except Exception as error:  # noqa: BLE001 - recorded for the test
                result[case] = f"{type(error).__name__}: {error}"
    elif scenario == "user-gather":
        mine = torch.full((2,), float(accelerator.process_index))
        result["gathered"] = accelerator.gather(mine).tolist()
        result["reduced"] = accelerator.reduce(mine, "sum").tolist()
        result["device"] = str(accelerator.gather(mine).device)
    else:
        workers = 2 if scenario == "workers" else 0
        loader = DataLoader(
            WhoLoads(),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            pin_memory=workers > 0,
            persistent_workers=workers > 0,
            worker_init_fn=mark_worker if workers else None,
        )
        loader = accelerator.prepare(loader)
        try:
            for epoch in range(2):
                seen, pids = [], set()
                for indices, loaded_by in loader:
                    seen += indices.tolist()
                    pids |= set(loaded_by.tolist())
                result[f"epoch{epoch}"] = {"items": seen, "pids": sorted(pids)}
        except RuntimeError as error:
            result["error"] = f"{type(error).__name__}: {error}"
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_scenarios(run)
