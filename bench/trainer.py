"""lowbit under transformers' Trainer against stock Accelerate under Trainer: step time, side by side.

    python bench/trainer.py [--rounds 6] [--steps 30] [--hidden 256] [--seq 128]

One process, one thread. The same Trainer script (tiny random-weight Llama, synthetic tokens, as
tests/trainer/trainer_worker.py) trains in short runs that alternate between stock Accelerate and
lowbit (``lowbit.patch_trainer()`` / ``unpatch_trainer()`` between them, which is what ``lowbit
launch`` does for a script); each run's optimizer-step times after 5 warm-up steps give a median,
and the table shows the median over rounds of the lowbit/stock ratio of adjacent runs. Target for
bf16: <= 1.02. FP8 is compared with lowbit's bf16 (stock Accelerate + Trainer + torchao FP8 does
not train the FP8 layers: its optimizer misses them, so its time is not a fair peer), and lowbit's
FP8 GEMMs are emulated on a CPU. lowbit runs with every default on (the throughput meter, the
non-finite check).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from lowbit.cli.env_command import describe_cpu  # what `lowbit env` says of this CPU


def build(hidden: int, seq: int):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
    )
    ids = torch.randint(0, 1024, (512, seq), generator=torch.Generator().manual_seed(1)).tolist()
    return LlamaForCausalLM(config), Dataset.from_dict({"input_ids": ids, "labels": ids})


class StepTimer:
    """Seconds per optimizer step, from Trainer's callbacks."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.times.append(time.perf_counter() - timer.start)

        self.callback, self.times, self.start = Callback(), [], 0.0


def one_run(library: str, precision: str, args: argparse.Namespace) -> tuple[float, str]:
    """Median step seconds of one Trainer run, and the Accelerator class that ran it."""
    from transformers import Trainer, TrainingArguments

    import lowbit

    (lowbit.patch_trainer if library == "lowbit" else lowbit.unpatch_trainer)()
    os.environ.pop("LOWBIT_MIXED_PRECISION", None)
    if precision == "fp8":
        os.environ["LOWBIT_MIXED_PRECISION"] = "fp8"  # what `lowbit launch --mixed_precision fp8` sets
    model, data = build(args.hidden, args.seq)
    timer = StepTimer()
    training = TrainingArguments(
        output_dir="runs/bench_trainer",
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-4,
        bf16=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[timer.callback])
    trainer.train()
    ran = f"{type(trainer.accelerator).__module__.split('.')[0]} {trainer.accelerator.mixed_precision}"
    return statistics.median(timer.times[5:]), ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    pairs = {
        "bf16: lowbit / stock": ("lowbit", "bf16", "stock", "bf16"),
        "fp8 (lowbit) / bf16 (lowbit)": ("lowbit", "fp8", "lowbit", "bf16"),
    }
    print(
        f"{describe_cpu()}, torch {torch.__version__}, transformers {transformers.__version__}; Llama hidden "
        f"{args.hidden}, "
        f"4 layers, batch 8 x {args.seq} tokens, {args.steps} steps a run, {args.rounds} rounds\n"
    )
    print(f"{'comparison':<30} {'first ms':>9} {'second ms':>10} {'ratio':>7}  ran")
    for label, (lib_a, prec_a, lib_b, prec_b) in pairs.items():
        ratios, firsts, seconds = [], [], []
        for index in range(args.rounds):
            order = [(lib_a, prec_a), (lib_b, prec_b)] if index % 2 == 0 else [(lib_b, prec_b), (lib_a, prec_a)]
            timed = {run: one_run(*run, args) for run in order}
            (a, ran_a), (b, ran_b) = timed[(lib_a, prec_a)], timed[(lib_b, prec_b)]
            firsts.append(a)
            seconds.append(b)
            ratios.append(a / b)
        print(
            f"{label:<30} {1000 * statistics.median(firsts):>9.2f} {1000 * statistics.median(seconds):>10.2f} "
            f"{statistics.median(ratios):>7.3f}  {ran_a} / {ran_b}"
        )


if __name__ == "__main__":
    main()
