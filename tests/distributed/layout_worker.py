"""A tiny transformers Llama trained on an N-D layout (ParallelismConfig), and the same steps in
plain PyTorch on one process over the global batch, to compare.

    lowbit launch --cpu --num_processes N [--use_fsdp] layout_worker.py OUT_DIR dp_shard_size=2,tp_size=2 [...]
    python layout_worker.py OUT_DIR mp=fp8      # one process, no layout: the same run to compare with

Each argument after OUT_DIR is one run, its keys comma-separated; several run in turn in one launch
(each with an Accelerator of its own), run K writing OUT_DIR/K/result.json. The keys: the
ParallelismConfig sizes, ``mp=<mixed_precision>``, ``ac=<full|selective>``,
``compile=<whole|regional>`` (regional: each decoder block compiled once, as Accelerate's),
``backend=<torch.compile backend>`` (inductor unless given), ``recipe=<ao recipe>``;
``steps=K`` trains the first K steps only, then ``save=DIR`` saves the training state; ``resume=DIR``
loads one first (``switch=1``: saved in another precision) and trains from where it stopped.
Rank 0 writes ``result.json``: the layout's loss at each step it ran (averaged over the
data-parallel ranks, as the global batch's mean) and the reference's for all STEPS.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lowbit import Accelerator
from lowbit.utils import FullyShardedDataParallelPlugin, ParallelismConfig, TorchDynamoPlugin

STEPS = 4
GLOBAL_BATCH, SEQUENCE, VOCAB = 8, 16, 128


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQUENCE), generator=generator) for _ in range(STEPS)]


def reference_losses(model: torch.nn.Module) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    out_dir = Path(sys.argv[1])
    accelerator = None
    for index, spec in enumerate(sys.argv[2:]):
        (out_dir / str(index)).mkdir(parents=True, exist_ok=True)
        accelerator = run(out_dir / str(index), dict(arg.split("=", 1) for arg in spec.split(",")))
    accelerator.end_training()


def run(out_dir: Path, args: dict[str, str]) -> Accelerator:
    sizes = {k: int(v) for k, v in args.items() if k.endswith("_size")}
    layout = ParallelismConfig(**sizes)
    fsdp = FullyShardedDataParallelPlugin(activation_checkpointing=args.get("ac", False)) if "ac" in args else None
    dynamo = (
        TorchDynamoPlugin(
            backend=args.get("backend", "inductor"), use_regional_compilation=args["compile"] == "regional"
        )
        if "compile" in args
        else None
    )
    handlers = []
    if "recipe" in args:
        from lowbit.utils import AORecipeKwargs

        handlers = [AORecipeKwargs(recipe=args["recipe"])]
    accelerator = Accelerator(
        mixed_precision=args.get("mp", "no"),
        parallelism_config=layout,
        fsdp_plugin=fsdp,
        dynamo_plugin=dynamo,
        kwargs_handlers=handlers,
    )
    model = tiny_llama()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The loader gives each data-parallel rank its share of the global batch; tp ranks share one.
    loader = torch.utils.data.DataLoader(torch.cat(batches()), batch_size=GLOBAL_BATCH // layout.data_parallel_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    mesh = accelerator.torch_device_mesh
    dp_group = mesh["dp"].get_group() if mesh is not None and layout.dp_dim_names else None
    batches_to_run = loader
    if "resume" in args:
        accelerator.load_state(args["resume"], allow_precision_change=args.get("switch") == "1")
        # A global step is the same rows on any number of ranks: skip the steps the save had done.
        batches_to_run = accelerator.skip_first_batches(loader, accelerator.step)
    losses = []
    for tokens in batches_to_run:
        if len(losses) == int(args.get("steps", STEPS)):
            break
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.step += 1
        mean = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=dp_group)
        losses.append(mean.item())
    if "save" in args:
        accelerator.save_state(args["save"])
    if accelerator.is_main_process:
        result = {
            "losses": losses,
            "reference": reference_losses(reference),
            "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh is not None else {},
            "distributed_type": str(accelerator.distributed_type),
            "batches_per_rank": len(loader),
            "fp8_report": accelerator.fp8_report() if accelerator.fp8_backend else "",
            "use_cache": getattr(accelerator.unwrap_model(model).config, "use_cache", None),
        }
        (out_dir / "result.json").write_text(json.dumps(result))
    return accelerator


if __name__ == "__main__":
    main()
