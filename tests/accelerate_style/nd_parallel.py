"""Training on an N-D layout the way Accelerate's torch_native_parallelism examples do it (their
API calls, offline: a tiny Llama saved to disk, synthetic tokens), under lowbit with only the
import changed:

    lowbit launch --cpu --num_processes 2 [--use_fsdp] nd_parallel.py MODEL_DIR OUT_DIR --tp-size 2
    lowbit launch --num_processes 2 --use_fsdp nd_parallel.py MODEL_DIR OUT_DIR --cp-size 2   # 2 CUDA GPUs

The model is loaded tensor-parallel by transformers (``tp_plan="auto"`` and the Accelerator's mesh)
when only tp is on; every layout checkpoints with ``save_state`` and ends with ``save_pretrained``.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lowbit import Accelerator
from lowbit.parallelism_config import ParallelismConfig
from lowbit.utils import FullyShardedDataParallelPlugin, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("model_dir")
parser.add_argument("out_dir")
for dim in ("dp-replicate", "dp-shard", "tp", "cp"):
    parser.add_argument(f"--{dim}-size", type=int, default=1)
args = parser.parse_args()
set_seed(42)

layout = ParallelismConfig(
    dp_replicate_size=args.dp_replicate_size,
    dp_shard_size=args.dp_shard_size,
    tp_size=args.tp_size,
    cp_size=args.cp_size,
)
fsdp = None
if layout.dp_shard_enabled or layout.cp_enabled:
    fsdp = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
    )
accelerator = Accelerator(mixed_precision="bf16", parallelism_config=layout, fsdp_plugin=fsdp)
laid_out_by_transformers = layout.tp_enabled and not layout.dp_shard_enabled
extra = (
    {"tp_size": args.tp_size, "tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh}
    if laid_out_by_transformers
    else {}
)
model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, use_cache=False, **extra)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
tokens = torch.randint(0, model.config.vocab_size, (16, 33), generator=torch.Generator().manual_seed(0))
# Targets given shifted already (shift_labels): under context parallelism each rank holds a slice of
# every sequence, and transformers' own shift would cross the slices.
samples = [{"input_ids": t[:-1], "labels": t[1:], "shift_labels": t[1:]} for t in tokens]
loader = DataLoader(samples, batch_size=2, collate_fn=lambda b: {k: torch.stack([s[k] for s in b]) for k in b[0]})
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

losses = []
for step, batch in enumerate(loader):
    batch["position_ids"] = torch.arange(batch["input_ids"].size(1)).unsqueeze(0)
    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
    buffers = [batch["input_ids"], batch["labels"], batch["shift_labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        group = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
    losses.append(loss.item())
    if step == 1:
        accelerator.save_state(f"{args.out_dir}/checkpoint-{step}")
model.save_pretrained(f"{args.out_dir}/model")
if accelerator.is_main_process:
    with open(f"{args.out_dir}/result.json", "w") as handle:
        json.dump(
            {"losses": losses, "steps": len(loader), "distributed_type": str(accelerator.distributed_type)}, handle
        )
accelerator.end_training()
