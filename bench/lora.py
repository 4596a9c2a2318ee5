"""FP8 LoRA against bf16 LoRA and an FP8 full fine-tune, side by side in one run.

    python bench/lora.py                                  # CPU: a small Llama (hidden 512, 2 layers, seq 256)
    python bench/lora.py --shape llama3-8b --device cuda  # GPU: Llama-3-8B-shaped layers (4 layers, seq 4096)
    python bench/lora.py --dry-run                        # tiny, on the CPU: checks the script (CI runs it)

PEFT's LoRA (r=16 on all seven projections) on a random-weight Llama built from a config (nothing
downloaded). Each setup is prepared by lowbit in this process; its steps are timed in alternating
rounds (each round one step of every setup), so that all see the same machine state, and each
reports the median. Per setup: step time and its ratio to bf16 LoRA, the GEMMs of one step (counted
with a ``TorchDispatchMode`` over mm, addmm, bmm and ``_scaled_mm``), the bytes the projections'
weights hold (LoRA: the frozen bases, adapters apart), and memory: the CUDA allocator's peak on a
GPU; on a CPU the bytes held after a step by parameters, gradients and optimizer states.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plugins" / "ao"))
from lora_helpers import PROJECTIONS, counting_gemms  # noqa: E402

warnings.filterwarnings("ignore")

SHAPES = {
    "dry-run": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=1, heads=4, kv=2, vocab=256, seq=32, rows=2
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=2, heads=8, kv=4, vocab=2048, seq=256, rows=2
    ),
    # Llama-3-8B's layer (hidden 4096, MLP 14336, 32 heads, 8 KV heads, vocab 128256), 4 of its 32 layers
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, heads=32, kv=8, vocab=128256, seq=4096, rows=1
    ),
}
SETUPS = ("bf16 LoRA", "fp8 LoRA", "fp8 full")


def build(shape: dict, lora: bool, device: str):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        max_position_embeddings=shape["seq"],
    )
    with torch.device(device):
        model = LlamaForCausalLM(config)
    if lora:
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS))
    return model


def projection_bytes(model) -> int:
    """Bytes the seven projections' weights hold (a LoRA model's frozen bases; its adapters apart)."""
    total = 0
    for name, module in model.named_modules():
        last = name.rpartition(".")[2]
        if last in PROJECTIONS and not hasattr(module, "base_layer") or last == "base_layer":
            for tensor in (module.weight, getattr(module, "weight_scale_inv", None)):
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
    return total


def held_bytes(model, optimizer) -> int:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    buffers = list(model.buffers())
    return sum(t.numel() * t.element_size() for t in [*params, *grads, *states, *buffers])


class Setup:
    def __init__(self, label: str, shape: dict, device: str, compiled: bool):
        from lowbit import Accelerator
        from lowbit.utils import AORecipeKwargs

        precision = "bf16" if label.startswith("bf16") else "fp8"
        handlers = [AORecipeKwargs()] if precision == "fp8" else []
        self.acc = Accelerator(
            mixed_precision=precision,
            kwargs_handlers=handlers,
            cpu=device == "cpu",
            dynamo_backend="inductor" if compiled else None,
        )
        model = build(shape, lora="LoRA" in label, device=device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, shape["vocab"], (shape["rows"], shape["seq"]), generator=generator).to(device)
        self.label, self.times = label, []
        self.base_bytes = projection_bytes(self.acc.unwrap_model(self.model))

    def step(self) -> None:
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        self.acc.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self, device: str) -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.step()
        if device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)

    def gemms(self) -> int:
        with counting_gemms() as counter:
            self.step()
        return counter.count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="torch.compile each prepared model (inductor)")
    parser.add_argument("--budget", type=float, default=480, help="seconds for the timed rounds (default 480)")
    parser.add_argument("--dry-run", action="store_true", help="tiny, on the CPU, one round: checks the script")
    args = parser.parse_args()
    if args.dry_run:
        args.shape, args.device, args.steps, args.warmup = "dry-run", "cpu", 1, 1
    if args.device == "cpu":
        torch.set_num_threads(1)  # ratios, not speed: one thread jitters least on a shared 2-core machine
    shape = SHAPES[args.shape]
    from lowbit.cli.env_command import describe_cpu

    where = torch.cuda.get_device_name() if args.device == "cuda" else describe_cpu()
    print(f"LoRA r=16 on {args.shape} ({shape['num_hidden_layers']} layers, seq {shape['seq']}) on {where}", flush=True)
    setups = []
    for label in SETUPS:
        setups.append(Setup(label, shape, args.device, args.compile))
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
    gemms = {}
    for setup in setups:
        for _ in range(args.warmup):
            setup.step()
        gemms[setup.label] = setup.gemms()
    start = time.perf_counter()
    for done in range(args.steps):
        for setup in setups if done % 2 == 0 else reversed(setups):
            setup.timed_step(args.device)
        print(f"  round {done + 1}/{args.steps}", flush=True)
        if time.perf_counter() - start > args.budget:
            print(f"  stopped after {done + 1} rounds: past the {args.budget:.0f} s budget", flush=True)
            break
    reference = statistics.median(setups[0].times)
    memory = "held MB" if args.device == "cpu" else "peak MB"
    print(f"\n{'setup':<10} {'step ms':>9} {'vs bf16 LoRA':>13} {'GEMMs':>6} {'projection MB':>14} {memory:>9}")
    for setup in setups:
        median = statistics.median(setup.times)
        if args.device == "cuda":
            torch.cuda.synchronize()
        used = held_bytes(setup.model, setup.optimizer)
        print(
            f"{setup.label:<10} {median * 1e3:>9.1f} {median / reference:>12.2f}x {gemms[setup.label]:>6} "
            f"{setup.base_bytes / 2**20:>14.1f} {used / 2**20:>9.1f}",
            flush=True,
        )
    del setups
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
