"""dispatch_batches and the seedable sampler, written as an Accelerate script and run unchanged under
`accelerate` and `lowbit` (only the import differs: ``--library``); each rank writes what it saw.

    torchrun --nproc_per_node 2 dispatch_batches.py --library accelerate OUT_DIR
    lowbit launch --cpu --num_processes 2 dispatch_batches.py --library lowbit OUT_DIR

For tests/test_accelerate_drop_in.py, which compares the two libraries' files key by key: each
case's batches per step on this rank, the gradient state at the last one, and what
``gather_for_metrics`` returns there.
"""

import argparse
import importlib
import json

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

parser = argparse.ArgumentParser()
parser.add_argument("--library", choices=["accelerate", "lowbit"], required=True)
parser.add_argument("out")
args = parser.parse_args()
lib = importlib.import_module(args.library)
utils = importlib.import_module(f"{args.library}.utils")


class Numbers(Dataset):
    def __init__(self, length: int):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return {"x": torch.tensor([float(index)]), "index": torch.tensor(index)}


class Stream(IterableDataset):
    """``length`` numbers; without ``__len__`` when ``sized`` is False (a stream of unknown length)."""

    def __init__(self, length: int):
        self.length = length

    def __iter__(self):
        for index in range(self.length):
            yield {"x": torch.tensor([float(index)]), "index": torch.tensor(index)}


class SizedStream(Stream):
    def __len__(self):
        return self.length


def read(accelerator, loader) -> dict:
    steps, last = [], {}
    for batch in loader:
        steps.append(batch["index"].tolist())
        if accelerator.gradient_state.end_of_dataloader:
            last = {
                "remainder": accelerator.gradient_state.remainder,
                "gathered": accelerator.gather_for_metrics(batch["index"]).tolist(),
            }
    return {"steps": steps, "last": last, "length": len(loader) if hasattr(loader.dataset, "__len__") else None}


CASES = {  # name -> (dataset, DataLoader arguments, DataLoaderConfiguration arguments)
    "map-dispatch": (lambda: Numbers(22), {"batch_size": 4}, {"dispatch_batches": True}),
    "map-dispatch-shuffled": (lambda: Numbers(22), {"batch_size": 4, "shuffle": True}, {"dispatch_batches": True}),
    "map-dispatch-split": (lambda: Numbers(22), {"batch_size": 4}, {"dispatch_batches": True, "split_batches": True}),
    "map-dispatch-drop-last": (lambda: Numbers(22), {"batch_size": 4, "drop_last": True}, {"dispatch_batches": True}),
    "stream-sized": (lambda: SizedStream(21), {"batch_size": 4}, {}),
    "stream-unknown-length": (lambda: Stream(21), {"batch_size": 4}, {}),
    "stream-unknown-length-split": (lambda: Stream(21), {"batch_size": 4}, {"split_batches": True}),
    "stream-not-dispatched": (lambda: SizedStream(21), {"batch_size": 4}, {"dispatch_batches": False}),
}
if args.library == "lowbit":  # Accelerate 1.15 stops here (len() of a stream without one)
    CASES["stream-unknown-length-not-dispatched"] = (lambda: Stream(21), {"batch_size": 4}, {"dispatch_batches": False})


def seedable(accelerator_class, config_class) -> list:
    """Two epochs, then set_seed and set_epoch(0) and two more: the same items (use_seedable_sampler)."""
    utils.set_seed(42)
    accelerator = accelerator_class(dataloader_config=config_class(use_seedable_sampler=True))
    loader = accelerator.prepare(DataLoader(Numbers(10), batch_size=2, shuffle=True))
    items = []
    for round_ in range(2):
        if round_:
            utils.set_seed(42)
            loader.set_epoch(0)
        for _ in range(2):
            items.append([i for batch in loader for i in batch["index"].tolist()])
    return items


def main() -> None:
    results = {}
    for name, (dataset, loader_args, config) in CASES.items():
        utils.set_seed(0)
        accelerator = lib.Accelerator(cpu=True, dataloader_config=utils.DataLoaderConfiguration(**config))
        loader = accelerator.prepare(DataLoader(dataset(), **loader_args))
        results[name] = [read(accelerator, loader) for _epoch in range(2)]
    results["seedable"] = seedable(lib.Accelerator, utils.DataLoaderConfiguration)
    accelerator = lib.Accelerator(cpu=True)
    with open(f"{args.out}/result_rank{accelerator.process_index}.json", "w") as handle:
        json.dump(results, handle)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
