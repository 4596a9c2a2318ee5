"""FSDP2 preparation as several GPUs meet it, one scenario per run; each rank writes what it saw.
For tests/core/training/test_multi_gpu_rules.py.

    lowbit launch --cpu --num_processes 2 --use_fsdp [--mixed_precision fp8] fsdp_worker.py SCENARIO OUT_DIR

SCENARIO: ``placement`` (where prepare() moves the model, in order with fully_shard),
``gather-dtype`` (the dtype each linear layer's weight has when its forward runs),
``sync-each-batch`` (gradients after a micro-batch that does not step, with sync_each_batch),
``moe`` (which modules become FSDP units, and training with experts that no token reaches on a rank),
``shared`` (ALBERT-style: one block listed three times and applied three times, and a head tied to
the embedding; trains under FSDP2 or, without --use_fsdp, DDP, to compare),
``again`` (free_memory() then prepare() of the same model and optimizer, as Trainer does at each train()),
``join`` (join_uneven_inputs with even_batches=False under DDP), ``join-nan`` (the same, a NaN on
the lone step). Several, comma-separated, run in one launch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed.fsdp as fsdp_module
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import mlp, run_scenarios  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.utils import AORecipeKwargs, GradientAccumulationPlugin  # noqa: E402


class Experts(nn.Module):
    """A block with two experts; ``route`` picks the expert every token goes to."""

    def __init__(self, width: int):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.route = 0

    def forward(self, x):
        return x + self.experts[self.route](x)


class MoE(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Experts(width) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def placement(out: dict) -> None:
    """Record each Module.to of the whole model, and each fully_shard, in the order they come."""
    events: list[str] = []
    model = mlp(seed=0, width=64)
    original_to, original_shard = nn.Module.to, fsdp_module.fully_shard

    def recording_to(self, *args, **kwargs):
        if self is model:
            events.append("whole model .to()")
        return original_to(self, *args, **kwargs)

    def recording_shard(module, **kwargs):
        events.append(f"fully_shard {type(module).__name__}")
        return original_shard(module, **kwargs)

    nn.Module.to, fsdp_module.fully_shard = recording_to, recording_shard
    accelerator = Accelerator()
    accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    out.update(events=events, process_index=accelerator.process_index)


def gather_dtype(out: dict) -> None:
    accelerator = Accelerator(kwargs_handlers=[AORecipeKwargs(recipe="rowwise")])
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    seen: dict[str, str] = {}
    for name, module in accelerator.unwrap_model(model).named_modules():
        if hasattr(module, "weight") and isinstance(module.weight, torch.Tensor):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, str(m.weight.dtype)))
    accelerator.backward(model(torch.randn(16, 64, device=accelerator.device)).float().pow(2).mean())
    optimizer.step()
    out.update(
        weight_dtypes=seen,
        shard_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        process_index=accelerator.process_index,
    )


def sync_each_batch(out: dict) -> None:
    accelerator = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    )
    model = mlp(seed=0, width=64)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.randn(8, 32, device=accelerator.device)).pow(2).mean())
    out.update(
        stepping=accelerator.sync_gradients,
        reduced=all(p.grad is not None for p in model.parameters()),
        process_index=accelerator.process_index,
    )


def moe(out: dict) -> None:
    accelerator = Accelerator()
    model = MoE()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    units = sorted(
        name or "<root>"
        for name, m in accelerator.unwrap_model(model).named_modules()
        if isinstance(m, fsdp_module.FSDPModule)
    )
    for layer in accelerator.unwrap_model(model).layers:
        layer.route = accelerator.process_index  # rank 0's tokens reach expert 0 only, rank 1's expert 1
    losses = []
    for _ in range(3):
        loss = model(torch.randn(8, 32, device=accelerator.device)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out.update(units=units, losses=losses, process_index=accelerator.process_index)


class SharedBlocks(nn.Module):
    """One block object in a ModuleList three times (ALBERT's shared layers), a tied head."""

    def __init__(self, width: int = 32, vocab: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        block = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.layers = nn.ModuleList([block, block, block])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def shared(out: dict) -> None:
    accelerator = Accelerator()
    model = SharedBlocks()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (8, 6), generator=generator) for _ in range(8)]
    losses = []
    for ids in batches[accelerator.process_index :: 2]:
        ids = ids.to(accelerator.device)
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    out.update(losses=losses, process_index=accelerator.process_index)


def again(out: dict) -> None:
    """Trainer's way of training twice: free_memory(), then prepare() of the same model object and
    of the optimizer prepare() returned. Copy A trains 4 steps in one preparation; copy B 2, is
    freed and prepared again, then 2 more. Both must end alike (nothing converted or laid out twice,
    the optimizer stepping the live parameters), and the forward wrapped once."""
    import copy

    accelerator = Accelerator()
    base = mlp(seed=0, width=64)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 32, generator=generator) for _ in range(8)][accelerator.process_index :: 2]

    def train(prepared, optimizer, steps):
        for x in steps:
            loss = prepared(x.to(accelerator.device)).float().pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    def checksum(model) -> float:
        unwrapped = accelerator.unwrap_model(model)
        return float(
            sum(
                accelerator.gather(p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).double().sum()
                for p in unwrapped.parameters()
            )
        )

    straight = copy.deepcopy(base)
    prepared, optimizer = accelerator.prepare(straight, torch.optim.AdamW(straight.parameters(), lr=1e-2))
    train(prepared, optimizer, batches)
    out["straight"] = checksum(prepared)
    accelerator.free_memory()

    twice = copy.deepcopy(base)
    prepared, optimizer = accelerator.prepare(twice, torch.optim.AdamW(twice.parameters(), lr=1e-2))
    train(prepared, optimizer, batches[:2])
    accelerator.free_memory()
    prepared, optimizer = accelerator.prepare(twice, optimizer)
    train(prepared, optimizer, batches[2:])
    out["twice"] = checksum(prepared)
    inner = accelerator.unwrap_model(prepared)
    forward, wrappers = inner.forward, 0
    while hasattr(forward, "__wrapped__"):
        forward, wrappers = forward.__wrapped__, wrappers + 1
    out["forward_wrappers"] = wrappers
    out.update(type=type(prepared).__name__, layer=type(inner[2]).__name__, process_index=accelerator.process_index)


def join(out: dict) -> None:
    """join_uneven_inputs(even_batches=False) over 5 batches on 2 DDP ranks: rank 0 trains 3, rank 1
    trains 2 and shadows rank 0's last all-reduce instead of hanging; the loader pads again after."""
    accelerator = Accelerator()
    model = mlp(seed=0, width=64)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.randn(10, 32), batch_size=2))
    batches = 0
    with accelerator.join_uneven_inputs([model], even_batches=False):
        for x in loader:
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
    out.update(join_batches=batches, batches_after=len(list(loader)), process_index=accelerator.process_index)


def join_nan(out: dict) -> None:
    """``join`` with the preemption poll at every step and a NaN loss on rank 0's lone third step
    (rank 1 joined): the skipped step polls as the joined rank's shadow does (it crashed the job in a
    gloo collective mismatch)."""
    import os

    os.environ["LOWBIT_PREEMPTION_POLL_STEPS"] = "1"
    accelerator = Accelerator()
    model = mlp(seed=0, width=64)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.randn(10, 32), batch_size=2))
    batches, skipped = 0, 0
    with accelerator.join_uneven_inputs([model], even_batches=False):
        for x in loader:
            loss = model(x).pow(2).mean()
            if batches == 2:  # rank 0's lone step
                loss = loss * float("nan")
            accelerator.backward(loss)
            optimizer.step()
            skipped += int(accelerator.optimizer_step_was_skipped)
            optimizer.zero_grad()
            batches += 1
    out.update(join_nan_batches=batches, join_nan_skipped=skipped, process_index=accelerator.process_index)


def run(scenario: str, out_dir: Path) -> None:
    out: dict = {}
    {
        "placement": placement,
        "gather-dtype": gather_dtype,
        "sync-each-batch": sync_each_batch,
        "moe": moe,
        "shared": shared,
        "again": again,
        "join": join,
        "join-nan": join_nan,
    }[scenario](out)
    (out_dir / f"rank{out['process_index']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    run_scenarios(run)  # fsdp_worker.py SCENARIO[,...] OUT_DIR: rank R of each writes OUT_DIR/SCENARIO/rankR.json
