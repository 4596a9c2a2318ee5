"""One rank of a job whose weights only rank 0 holds before ``prepare()`` (tests/core/builtin/test_rank0_weights.py):

- ``scrambled``: rank 0 builds the model from seed 0, the others from another seed;
- ``empty``: the others build it under ``init_empty_weights`` (the meta device);
- ``tied``: a head tied to its embedding, the others under ``init_empty_weights``; ``tied-bf16`` and
  ``tied-wider``: rank 1's model differs from rank 0's in dtype or shape (refused, naming it);
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


class TiedNet(nn.Module):
    """A head tied to its embedding, as Llama's tie_word_embeddings and GPT-2's lm_head."""

    def __init__(self, seed: int, width: int = 32):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids))))


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
    elif mode.startswith("tied"):  # tied: the others empty; tied-bf16 / tied-wider: rank 1's model differs
        model = TiedNet(seed=0)
        if rank > 0:
            with lowbit.init_empty_weights(include_buffers=True):
                model = TiedNet(seed=0, width=48 if mode == "tied-wider" else 32)
            if mode == "tied-bf16":
                model = model.to(torch.bfloat16)
        expected = whole(TiedNet(seed=0))
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

    inner = accelerator.unwrap_model(model)
    report = {
        "tied_after": isinstance(inner, TiedNet) and inner.head.weight is inner.embed.weight,
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
