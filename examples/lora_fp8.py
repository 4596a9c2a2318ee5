"""LoRA in FP8: PEFT's LoRA on a small Llama, its frozen base stored and run in FP8 by lowbit.

    python examples/lora_fp8.py                 # CPU (FP8 GEMMs emulated), seconds
    python examples/lora_fp8.py --device cuda   # an sm_89+ GPU: torch._scaled_mm

An Accelerate script with PEFT, as people write it; only the import is lowbit's. lowbit decides
once at ``prepare()`` what each Linear is: the 28 LoRA adapters stay in high precision; the frozen
base layers (but the model's first and last Linear) are quantized once to FP8, their high-precision
weights freed, and run two FP8 GEMMs a step (forward, input gradient), none for the weight. The
FP8 report says so. The run learns to count (each token one more than the last), saves its adapters
with PEFT's ``save_pretrained``, and merges them into a plain model (``dequant(W) + ΔW``, out of
place), which it checks against the LoRA model. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lowbit import Accelerator  # the one change from an Accelerate script: `from accelerate import Accelerator`

VOCAB, SEQ = 128, 32
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
)


def counting_rows(count: int, seed: int) -> torch.Tensor:
    """Rows of tokens that count up from a random start (mod the vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (count, 1), generator=generator)
    return (start + torch.arange(SEQ)) % VOCAB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--output_dir", default="runs/lora_fp8")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))  # in real use: from_pretrained(...)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=projections))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    loader = DataLoader(TensorDataset(counting_rows(8 * args.steps, seed=0)), batch_size=8)

    accelerator = Accelerator(mixed_precision="fp8", cpu=args.device == "cpu")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(accelerator.fp8_report())

    start = time.perf_counter()
    for step, (ids,) in enumerate(loader):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            accelerator.print(f"step {step:>3}  loss {loss.item():.3f}  ({time.perf_counter() - start:.0f} s)")

    output = Path(args.output_dir)
    accelerator.unwrap_model(model).save_pretrained(output / "adapters")  # PEFT's adapters, as always
    if accelerator.fp8_backend == "ao":
        from lowbit_ao.lora_merge import merged_state_dict

        merged = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(accelerator.device)
        merged.load_state_dict(merged_state_dict(accelerator.unwrap_model(model), dtype=torch.float32))
        ids = counting_rows(8, seed=1).to(accelerator.device)
        with torch.no_grad():
            ours, theirs = model(input_ids=ids).logits.float(), merged(input_ids=ids).logits.float()
        agree = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0).item()
        accelerator.print(
            f"adapters in {output / 'adapters'}; the merged fp32 model's logits agree: cosine {agree:.4f}"
        )


if __name__ == "__main__":
    main()
