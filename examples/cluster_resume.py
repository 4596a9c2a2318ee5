"""A training script that survives a cluster: torchrun's restarts (`--max_restarts`), a scheduler's
preemption (SIGTERM) and early warning (SIGUSR1), and a job the scheduler requeues all continue
from the newest checkpoint, with the losses the uninterrupted run would have had.

    lowbit launch --cpu --num_processes 2 --max_restarts 3 examples/cluster_resume.py --project_dir runs/resume
    srun --ntasks-per-node=1 lowbit launch --max_restarts 3 examples/cluster_resume.py --project_dir $SCRATCH/run

Checkpoints are named by Accelerate's rule (`<project_dir>/checkpoints/checkpoint_<N>`, the newest
`--keep` kept); a (re)started job loads the newest and skips the batches it already trained on.
`--crash_at STEP` makes the first attempt fail at that step, to see a restart resume.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator
from lowbit.utils import ProjectConfiguration


class Progress:
    """The step counter, saved and loaded with the checkpoint (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project_dir", default="runs/resume")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save_every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--crash_at", type=int, default=None)
    args = parser.parse_args()

    project = ProjectConfiguration(
        project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=args.keep
    )
    accelerator = Accelerator(project_config=project)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(args.steps * 8 * accelerator.num_processes, 16)
    dataset = torch.utils.data.TensorDataset(x, x.sin().sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.on_preemption(accelerator.save_state)  # SIGTERM: save, then stop; SIGUSR1: save, train on

    if list(Path(args.project_dir, "checkpoints").glob("checkpoint_*")):
        accelerator.load_state()  # the newest
        accelerator.print(f"resumed at step {progress.step}")
    batches = accelerator.skip_first_batches(loader, progress.step)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and progress.step == 0
    for inputs, targets in batches:
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        progress.step += 1
        accelerator.print(f"step {progress.step} loss {accelerator.reduce(loss.detach(), 'mean').item():.6f}")
        if progress.step % args.save_every == 0:
            accelerator.save_state()
        if args.crash_at == progress.step and first_attempt:
            raise RuntimeError(f"--crash_at {args.crash_at}: the first attempt fails here")
    accelerator.end_training()


if __name__ == "__main__":
    main()
