"""Fine-tune a small Llama with TRL's SFTTrainer: a plain TRL script, trained in FP8 by lowbit.

    lowbit launch --cpu --mixed_precision fp8 examples/sft_fp8.py            # one process
    lowbit launch --cpu --num_processes 2 --mixed_precision fp8 examples/sft_fp8.py
    python examples/sft_fp8.py            # the same script on stock Accelerate (bf16)

The script names no lowbit API: under ``lowbit launch`` transformers' Trainer (which SFTTrainer is)
builds lowbit's Accelerator, and ``--mixed_precision fp8`` wins over TRL's default ``bf16=True``
(with a note). Nothing is downloaded: the model is a random-weight Llama from a config, the
tokenizer is built in memory (one token per character), and the task is made up here: complete
"37+45=" with "82". On a GPU, leave out ``--cpu``.
"""

from __future__ import annotations

import argparse
import random

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

SYMBOLS = list("0123456789+=")


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", *SYMBOLS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def sums(count: int, seed: int) -> Dataset:
    """Prompt "a+b=", completion "a+b" written out: the loss is on the completion only."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(count)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "completion": [str(a + b) for a, b in pairs]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--output_dir", default="runs/sft_fp8")
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
        )
    )
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=32,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=20,
        eval_strategy="steps",
        eval_steps=args.steps // 2,
        per_device_eval_batch_size=64,
        save_strategy="no",
        report_to=[],
        max_length=16,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=sums(8192, seed=1),
        eval_dataset=sums(256, seed=2),
        processing_class=tokenizer,
    )
    trainer.train()

    if trainer.is_world_process_zero():
        acc = trainer.accelerator
        backend = getattr(acc, "fp8_backend", None)
        print(
            f"\ntrained by {type(acc).__module__.split('.')[0]} ({type(acc).__name__}), "
            f"mixed_precision={acc.mixed_precision}{f', backend {backend}' if backend else ''}"
        )
        print(f"{'step':>5} {'loss':>8} {'eval_loss':>10} {'tokens/s':>10}")
        for row in trainer.state.log_history:
            if "loss" in row or "eval_loss" in row:
                tokens = row.get("throughput/tokens_per_s")
                print(
                    f"{row['step']:>5} {row.get('loss', float('nan')):>8.4f} "
                    f"{row.get('eval_loss', float('nan')):>10.4f} "
                    f"{(f'{tokens:,.0f}' if tokens else '-'):>10}"
                )


if __name__ == "__main__":
    main()
