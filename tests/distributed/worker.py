"""Training scenarios, run by `lowbit launch` in several processes; each rank writes its results
into OUT_DIR/SCENARIO. Several scenarios (comma-separated) run in turn in one launch, each with an
Accelerator of its own (tests/core/builtin/test_distributed.py shares launches this way).

lowbit launch --cpu --num_processes 2 [--use_fsdp | --use_deepspeed --zero_stage N] worker.py SCENARIO[,...] OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import TiedLM, mlp, regression_data, run_scenarios  # noqa: E402

from lowbit import Accelerator  # noqa: E402

STEPS_PER_EPOCH = 4
PER_RANK_BATCH = 8


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 shard
        t = getattr(t, "ds_tensor", t)  # ZeRO-3 partition
        total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer) -> int:
    inner = optimizer
    while hasattr(inner, "optimizer"):  # lowbit's and DeepSpeed's wrappers around the torch optimizer
        inner = inner.optimizer
    return local_bytes(
        v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0
    )


def build(scenario: str, shuffle: bool = False):
    handlers = []
    if scenario.startswith("comm-hook-"):  # comm-hook-fp16, comm-hook-power_sgd, ...
        from lowbit.utils import DistributedDataParallelKwargs

        hook = scenario[len("comm-hook-") :]
        state = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2} if "power_sgd" in hook else {}
        handlers = [DistributedDataParallelKwargs(comm_hook=hook, comm_state_option=state)]
    if scenario.startswith("fp8"):
        from lowbit.utils import AORecipeKwargs

        handlers = [AORecipeKwargs()]  # float8 all-gather: on by default under FSDP2 (tensorwise)
    if scenario.startswith("block-"):  # block-mxfp8-ddp, block-nvfp4-fsdp: the precision comes from the flags
        from lowbit.utils import AORecipeKwargs

        handlers = [AORecipeKwargs(recipe="mxfp8")] if "mxfp8" in scenario else [AORecipeKwargs()]
    accelerator = Accelerator(kwargs_handlers=handlers)
    model = mlp(seed=0, width=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = regression_data(STEPS_PER_EPOCH * PER_RANK_BATCH * accelerator.num_processes)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=PER_RANK_BATCH, shuffle=shuffle
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def train(accelerator, model, optimizer, loader, epochs: int) -> list[float]:
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(accelerator.gather(loss.detach()).mean().item())
    return losses


def run(scenario: str, out: Path) -> None:
    if scenario == "resume":
        acc, model, opt, loader = build(scenario, shuffle=True)
        torch.manual_seed(123)
        train(acc, model, opt, loader, 1)
        acc.save_state(out / "ckpt")
        train(acc, model, opt, loader, 1)
        uninterrupted = acc.get_state_dict(model)
        acc2, model2, opt2, loader2 = build(scenario, shuffle=True)
        acc2.load_state(out / "ckpt")
        train(acc2, model2, opt2, loader2, 1)
        resumed = acc2.get_state_dict(model2)
        same = all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
        result = {"resumed_equals_uninterrupted": same}
    elif scenario == "fp8-fsdp-resume":
        # load_state on the same Accelerator after the weights moved on: the float8 all-gather's
        # precomputed scales must follow the loaded weights, and the sharded save must pickle.
        acc, model, opt, loader = build(scenario)
        train(acc, model, opt, loader, 1)
        acc.save_state(out / "ckpt")
        train(acc, model, opt, loader, 1)
        uninterrupted = acc.get_state_dict(model)
        train(acc, model, opt, loader, 1)
        acc.load_state(out / "ckpt")
        train(acc, model, opt, loader, 1)
        resumed = acc.get_state_dict(model)
        result = {
            "resumed_equals_uninterrupted": all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted),
            "fp8_report": acc.fp8_report(),
        }
    elif scenario == "tied-save":
        # A head tied to the embedding, under a strategy that shards: the full state dict is built
        # in the main process only, and the tied weight is written once.
        acc = Accelerator()
        model = TiedLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(acc.process_index))
        acc.backward(model(ids.to(acc.device)).float().pow(2).mean())
        opt.step()
        state = acc.get_state_dict(model)
        acc.save_model(model, out / "model")
        result = {
            "state_names": sorted(state),
            "tied_shared": state["head.weight"] is state["embed.weight"] if state else None,
        }
        if state:
            torch.save(state, out / "full_state.pt")
    elif scenario == "clip":
        # One SGD step at lr 1 after clip_grad_norm_(0.05): the weights move by exactly the
        # clipped norm when clipping took effect, by the full gradient norm when it did not.
        acc = Accelerator()
        model = mlp(seed=0, width=64)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        x, y = regression_data(PER_RANK_BATCH * acc.num_processes)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=PER_RANK_BATCH)
        model, opt, loader = acc.prepare(model, opt, loader)
        before = {k: v.float().clone() for k, v in acc.get_state_dict(model).items()}
        inputs, targets = next(iter(loader))
        acc.backward(nn.functional.mse_loss(model(inputs), targets))
        norm = acc.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        after = acc.get_state_dict(model)
        # Under ZeRO-3 / FSDP2 only the main process holds the gathered weights.
        update = float(sum(((after[k].float() - before[k]) ** 2).sum() for k in before) ** 0.5) if before else None
        result = {"norm": float(norm), "update": update}
    elif scenario == "nonfinite":
        # Rank 1 alone sees a NaN loss at its third step (its gradients stay finite): every rank
        # must skip that step, or the ranks' weights part ways.
        acc, model, opt, loader = build(scenario)
        skipped = []
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if step == 2 and acc.process_index == 1:
                loss = loss + float("nan")
            acc.backward(loss)
            opt.step()
            skipped.append(acc.optimizer_step_was_skipped)
        torch.save(acc.get_state_dict(model), out / f"state_rank{acc.process_index}.pt")
        result = {"skipped": skipped}
    elif scenario == "profile":
        acc, model, opt, loader = build(scenario)
        with acc.profile(out / "profile", wait=0, warmup=1, active=2) as prof:
            for x, y in loader:
                opt.zero_grad()
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                prof.step()
        result = {"profiled": True}
    else:
        acc, model, opt, loader = build(scenario)
        losses = train(acc, model, opt, loader, 3)
        state = acc.get_state_dict(model)
        if acc.is_main_process:
            torch.save(state, out / "final_state.pt")
        torch.save(state, out / f"state_rank{acc.process_index}.pt")
        result = {
            "strategy": acc.distributed_strategy,
            "fp8_backend": acc.fp8_backend,
            "fp8_report": acc.fp8_report(),
            "losses": losses,
            "param_bytes": local_bytes(acc.unwrap_model(model).parameters()),
            "optimizer_state_bytes": optimizer_state_bytes(opt),
            "comm_hook": model._get_ddp_logging_data().get("comm_hook")
            if hasattr(model, "_get_ddp_logging_data")
            else None,
            "weight_types": sorted(
                {type(getattr(p, "_local_tensor", p)).__name__ for p in acc.unwrap_model(model).parameters()}
            ),
        }
    result["world_size"] = acc.num_processes
    (out / f"result_rank{acc.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_scenarios(run)
