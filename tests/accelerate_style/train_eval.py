"""A training script written the way Accelerate's examples are (nlp_example / by_feature), run
unchanged under `accelerate` and `lowbit`: only the import differs (``--library``).

    python train_eval.py --library lowbit OUT_DIR
    lowbit launch --cpu --num_processes 2 train_eval.py --library lowbit OUT_DIR

Writes OUT_DIR/result_rank{N}.json: the eval accuracy and sample count per epoch, the learning
rates, the loss after resuming from a checkpoint, and what the tracker saw.
"""

import argparse
import importlib
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--library", choices=["accelerate", "lowbit"], required=True)
parser.add_argument("out")
args = parser.parse_args()
lib = importlib.import_module(args.library)
utils = importlib.import_module(f"{args.library}.utils")
Accelerator, set_seed, find_executable_batch_size = lib.Accelerator, utils.set_seed, utils.find_executable_batch_size
ProjectConfiguration = utils.ProjectConfiguration
DistributedType = utils.DistributedType
logger = importlib.import_module(f"{args.library}.logging").get_logger(__name__)


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(203, 16, generator=g)  # 203: the last eval batch is uneven across 2 processes
    labels = (x[:, :4].sum(1) > 0).long()
    return TensorDataset(x[:160], labels[:160]), TensorDataset(x[160:], labels[160:])


class Counter:
    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def main():
    accelerator = Accelerator(
        cpu=True,
        log_with="tensorboard",
        project_dir=args.out,
        project_config=ProjectConfiguration(project_dir=args.out),
    )
    set_seed(42)
    train_set, eval_set = make_data()
    with accelerator.main_process_first():
        train_loader = DataLoader(train_set, batch_size=16, shuffle=True)
        eval_loader = DataLoader(eval_set, batch_size=8)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.init_trackers("drop_in", config={"lr": 1e-2, "epochs": 2})
    result = {
        "distributed_type": str(accelerator.distributed_type.value),
        "epochs": [],
        "lrs": [],
        "first_batches": [],
        "rng_draws": [],
    }
    for epoch in range(2):
        model.train()
        for step, (x, y) in enumerate(train_loader):
            if step == 0:  # which samples, in which order: the shuffle must match Accelerate's
                result["first_batches"].append(round(float((x[:, 0] * torch.arange(len(x))).sum()), 5))
            loss = nn.functional.cross_entropy(model(x), y)
            # What dropout would draw here: torch's global RNG stream must be Accelerate's, batch by batch.
            result["rng_draws"].append(round(torch.rand(()).item(), 8))
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.seen += 1
            result["lrs"].append(scheduler.get_last_lr()[0])
        model.eval()
        correct, total = 0, 0
        for x, y in eval_loader:
            with torch.no_grad():
                predictions = model(x).argmax(-1)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accuracy = correct / total
        accelerator.log({"accuracy": accuracy, "train_loss": loss.item()}, step=epoch)
        logger.info(f"epoch {epoch}: accuracy {accuracy:.4f}")
        result["epochs"].append({"accuracy": round(accuracy, 6), "samples": total})
        accelerator.save_state(os.path.join(args.out, "checkpoint"))

    # Resume: reload the last checkpoint, skip the first batches, continue the same way. Under
    # Accelerate only the main process writes the checkpoint and nothing waits for it, so the other
    # ranks must wait before reading it back (without this, Accelerate's rank 1 was seen reading a
    # half-written file). lowbit's load_state waits by itself; the line is harmless there.
    accelerator.wait_for_everyone()
    accelerator.load_state(os.path.join(args.out, "checkpoint"))
    resumed = accelerator.skip_first_batches(train_loader, 2)
    x, y = next(iter(resumed))
    result["resumed_loss"] = round(nn.functional.cross_entropy(model(x), y).item(), 6)
    result["counter"] = counter.seen

    @find_executable_batch_size(starting_batch_size=64)
    def probe(batch_size):
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory. (simulated)")
        return batch_size

    result["batch_size"] = probe()
    result["total_samples"] = int(accelerator.reduce(torch.tensor(total), reduction="sum").item())
    accelerator.end_training()
    with open(os.path.join(args.out, f"result_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
