"""FP8 against BF16 on a ~1B-parameter Llama-shaped model, one GPU: step time and peak memory.

    python bench/gpu_llama.py                 # every FP8 backend that can run here, and bf16
    python bench/gpu_llama.py --steps 20 --seq 2048

Each configuration runs in its own process (clean memory peak), same seed, batch and AdamW; the
table gives median step time and peak allocated memory, and both as ratios to bf16. Needs a CUDA
GPU (FP8 backends: compute capability 8.9+) and ``transformers`` (the model is built from a
config, random weights, nothing downloaded).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def run_one(precision: str, backend: str | None, steps: int, seq: int, batch: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowbit import Accelerator
    from lowbit.utils import FP8RecipeKwargs

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, max_position_embeddings=seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    handlers = [FP8RecipeKwargs(backend=backend)] if backend else []
    accelerator = Accelerator(mixed_precision=precision, kwargs_handlers=handlers)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=accelerator.device)
    times, losses = [], []
    for step in range(steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        torch.cuda.synchronize()
        if step >= 3:  # warm-up: allocator, autotuning, FP8 scaling history
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"label": f"{precision}" + (f" ({accelerator.fp8_backend})" if precision == "fp8" else ""),
            "params": params, "step_ms": 1000 * statistics.median(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "final_loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--one", nargs=2, metavar=("PRECISION", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        precision, backend = args.one
        print(json.dumps(run_one(precision, None if backend == "-" else backend, args.steps, args.seq, args.batch)))
        return

    from lowbit.cli.plugins_command import collect

    fp8_backends = [r["name"] for r in collect()["plugins"] if r["kind"] == "fp8" and r["status"] == "available"]
    rows = []
    for precision, backend in [("bf16", "-"), *(("fp8", name) for name in fp8_backends)]:
        cmd = [sys.executable, __file__, "--one", precision, backend, "--steps", str(args.steps),
               "--seq", str(args.seq), "--batch", str(args.batch)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{precision} {backend}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if not rows:
        sys.exit("nothing ran")
    base = rows[0]
    print(f"Llama-shaped model, {base['params'] / 1e9:.2f} B parameters, batch {args.batch} x {args.seq} tokens, "
          f"AdamW, median of {args.steps} steps")
    print(f"{'precision':<16}{'step ms':>10}{'vs bf16':>9}{'peak GiB':>10}{'vs bf16':>9}{'final loss':>12}")
    for r in rows:
        print(f"{r['label']:<16}{r['step_ms']:>10.1f}{r['step_ms'] / base['step_ms']:>8.2f}x"
              f"{r['peak_gib']:>10.2f}{r['peak_gib'] / base['peak_gib']:>8.2f}x{r['final_loss']:>12.4f}")


if __name__ == "__main__":
    main()
