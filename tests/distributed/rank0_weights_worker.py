"""One rank of a job whose weights only rank 0 holds before ``prepare()`` (tests/core/builtin/test_rank0_weights.py):

- ``scrambled``: rank 0 builds the model from seed 0, the others from another seed;
- ``empty``: the others build it under ``init_empty_weights`` (the meta device);
- ``pretrained CKPT``: transformers' ``from_pretrained(CKPT)``, which under ``lowbit launch
  --fsdp_cpu_ram_efficient_loading true`` sees Accelerate's variables (is_fsdp_enabled); the other
  ranks' loaded weights are then scrambled, so that only prepare() can make them right.

After ``prepare`` each rank writes whether its weights were unloaded before, and the largest
difference between its whole weights and the checkpoint's (seed 0's model, or the saved files).

    lowbit launch --cpu --num_processes 2 [--use_fsdp --fsdp_cpu_ram_efficient_loading true] \\
        tests/distributed/rank0_weights_worker.py OUT MODE [CKPT]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import lowbit
from lowbit import Accelerator


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])
        self.out = nn.Linear(64, 8)
        self.register_buffer("scale", torch.rand(64), persistent=False)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.relu(block(h)) * self.scale
        return self.out(h)


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu() for k, v in tensors.items()}


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    if mode == "pretrained":
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(sys.argv[3], dtype=torch.float32)
        expected = {k: v.float() for k, v in load_file(str(Path(sys.argv[3]) / "model.safetensors")).items()}
        if rank > 0:  # what prepare() must overwrite: these ranks' weights are not the checkpoint's
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter))
    elif mode == "empty" and rank > 0:
        with lowbit.init_empty_weights(include_buffers=True):
            model = Net(seed=0)
        expected = whole(Net(seed=0))
    else:
        model = Net(seed=0 if rank == 0 else 100 + rank)
        expected = whole(Net(seed=0))
    unloaded = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    got = whole(accelerator.unwrap_model(model))
    diffs = {k: float((got[k] - v).abs().max()) for k, v in expected.items() if k in got}
    missing = sorted(set(expected) - set(got))
    from transformers.distributed.fsdp import is_fsdp_enabled

    report = {
        "transformers_loads_once_per_machine": is_fsdp_enabled(),
        "unloaded_before": unloaded,
        "max_diff": max(diffs.values()),
        "compared": len(diffs),
        "missing": missing,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    accelerator.end_training()


if __name__ == "__main__":
    main()
