"""One rank of ``bench/layouts.py``: a Llama trained a few steps on one N-D layout; rank 0 writes
the median step time, tokens/s and every rank's peak memory to OUT_FILE.

    lowbit launch --cpu --num_processes 4 [--use_fsdp] bench/layouts_worker.py OUT_FILE \\
        dp_shard_size=2 tp_size=2 mp=fp8 ac=full
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lowbit import Accelerator
from lowbit.utils import FullyShardedDataParallelPlugin, ParallelismConfig

SEQUENCE, GLOBAL_BATCH, STEPS, WARMUP = 256, 8, 6, 2


def peak_memory_mib(device: torch.device, baseline_kib: int) -> float:
    """The GPU's peak allocated bytes; on a CPU, the process's peak resident memory above what it
    held before the model was built (it counts every allocation, the allocator's slack included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib) / 1024


def main() -> None:
    out_file, args = sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:])
    layout = ParallelismConfig(**{k: int(v) for k, v in args.items() if k.endswith("_size")})
    fsdp = (
        FullyShardedDataParallelPlugin(activation_checkpointing=args.get("ac", False))
        if layout.dp_shard_enabled
        else None
    )
    accelerator = Accelerator(mixed_precision=args.get("mp", "bf16"), parallelism_config=layout, fsdp_plugin=fsdp)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1024,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            use_cache=False,
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 1024, (GLOBAL_BATCH * STEPS, SEQUENCE), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(tokens, batch_size=GLOBAL_BATCH // layout.data_parallel_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    times = []
    for batch in loader:
        start = time.perf_counter()
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    peaks = [None] * accelerator.num_processes
    dist.all_gather_object(peaks, peak_memory_mib(accelerator.device, baseline))
    if accelerator.is_main_process:
        step = statistics.median(times[WARMUP:])
        with open(out_file, "w") as handle:
            json.dump({"step_s": step, "tokens_per_s": GLOBAL_BATCH * SEQUENCE / step, "peak_mib": peaks}, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main()
