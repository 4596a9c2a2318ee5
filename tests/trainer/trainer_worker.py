"""A fine-tuning script as Trainer and TRL users write it: tiny random-weight Llama, synthetic data,
a local word-level tokenizer (nothing downloaded). It names no lowbit API: run it with ``python``
or ``torchrun`` and it trains on stock Accelerate; under ``lowbit launch`` (or with ``--lowbit-line``,
the one documented line) on lowbit.

    python trainer_worker.py OUT [--trainer trainer|sft|dpo|grpo] [--bf16] [--steps 20] [--resume CKPT]
        [--fsdp] [--deepspeed STAGE] [--lowbit-line] [--pretrained CKPT] [--lora]

``--lora``: PEFT's LoRA (r=8 on every projection) as each trainer's users add it: ``get_peft_model``
for Trainer, ``peft_config=`` for TRL's trainers. ``--trainer grpo``: TRL's GRPOTrainer with
transformers' own generation (no vLLM) and a reward that counts distinct words.

``--pretrained CKPT`` (with ``--fsdp``): ``from_pretrained`` a saved model under FSDP's
``cpu_ram_efficient_loading``, the weights of ranks above 0 scrambled after loading; the result
says how far each rank's prepared weights are from the checkpoint's when training begins.

Each process writes ``OUT/result_<rank>.json``: the logged losses, eval losses, what the optimizer
holds, which parameters moved, and the Accelerator that ran.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

VOCAB_WORDS = [f"w{i}" for i in range(125)]  # ids 3..127
SEQ, ROWS = 32, 256


def tokenizer():
    """A word-level tokenizer built in memory: ``<pad>``, ``<eos>``, ``<unk>`` and 125 words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *VOCAB_WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def pretrained(path: str):
    """A saved model, as rank 0 loads it; the other ranks' weights scrambled (prepare must fix them)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if int(os.environ.get("RANK", "0")) > 0:
        with torch.no_grad():
            for parameter in loaded.parameters():
                parameter.add_(torch.randn_like(parameter))
    return loaded


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config)


def rows(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (count, SEQ), generator=torch.Generator().manual_seed(seed))


def words(ids: torch.Tensor) -> str:
    return " ".join(VOCAB_WORDS[int(i) - 3] for i in ids)


def datasets(kind: str):
    from datasets import Dataset

    train, held_out = rows(ROWS, 1), rows(32, 2)
    if kind == "trainer":
        as_ids = lambda t: Dataset.from_dict({"input_ids": t.tolist(), "labels": t.tolist()})  # noqa: E731
        return as_ids(train), as_ids(held_out)
    if kind == "sft":
        as_text = lambda t: Dataset.from_dict({"text": [words(r) for r in t]})  # noqa: E731
        return as_text(train), as_text(held_out)
    if kind == "grpo":
        as_prompts = lambda t: Dataset.from_dict({"prompt": [words(r[:8]) for r in t]})  # noqa: E731
        return as_prompts(train[:64]), as_prompts(held_out[:8])
    as_pairs = (
        lambda t: Dataset.from_dict(
            {
                "prompt": [words(r[:8]) for r in t],
                "chosen": [words(r[8:20]) for r in t],  # noqa: E731
                "rejected": [words(r[20:]) for r in t],
            }
        )
    )
    return as_pairs(train), as_pairs(held_out)


def lora_config():
    from peft import LoraConfig

    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return LoraConfig(r=8, lora_alpha=16, target_modules=projections, task_type="CAUSAL_LM")


def distinct_words(completions, **kwargs) -> list[float]:
    """GRPO's reward: how many different words a completion uses (it can be learned, and it varies)."""
    return [float(len(set(str(c).split()))) for c in completions]


def trainer(args: argparse.Namespace):
    from transformers import Trainer, TrainingArguments

    common = dict(
        output_dir=args.out,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=5,
        max_steps=args.steps,
        logging_steps=5,
        save_steps=10,
        eval_strategy="steps",
        eval_steps=10,
        learning_rate=1e-3,
        seed=0,
        report_to=[],
        use_cpu=True,
        gradient_accumulation_steps=2,
        bf16=args.bf16,
        disable_tqdm=True,
        dataloader_num_workers=0,
        save_only_model=False,
    )
    if args.fsdp:
        common.update(
            fsdp="full_shard auto_wrap",
            fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "fsdp_version": 2},
        )
        if getattr(args, "pretrained", None):
            common["fsdp_config"]["cpu_ram_efficient_loading"] = True
    if args.deepspeed:
        common["deepspeed"] = {
            "zero_optimization": {"stage": args.deepspeed},
            "bf16": {"enabled": "auto"},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "train_batch_size": "auto",
        }
    train, held_out = datasets(args.trainer)
    lora = getattr(args, "lora", False)  # callers that build their own arguments (Ray, the patch tests) give none
    peft = {"peft_config": lora_config()} if lora else {}
    if args.trainer == "trainer":
        built = pretrained(args.pretrained) if getattr(args, "pretrained", None) else model()
        if lora:
            from peft import get_peft_model

            built = get_peft_model(built, lora_config())
        return Trainer(model=built, args=TrainingArguments(**common), train_dataset=train, eval_dataset=held_out)
    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, max_length=SEQ, packing=False, dataset_num_proc=None)
        return SFTTrainer(
            model=model(), args=config, train_dataset=train, eval_dataset=held_out, processing_class=tokenizer(), **peft
        )
    if args.trainer == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        common.update(per_device_train_batch_size=4, per_device_eval_batch_size=4, gradient_accumulation_steps=1)
        config = GRPOConfig(**common, num_generations=4, max_completion_length=8, use_vllm=False, temperature=1.0)
        return GRPOTrainer(
            model=model(),
            reward_funcs=distinct_words,
            args=config,
            train_dataset=train,
            eval_dataset=held_out,
            processing_class=tokenizer(),
            **peft,
        )
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(**common, max_length=SEQ, precompute_ref_log_probs=False)
    return DPOTrainer(
        model=model(),
        ref_model=None if lora else model(),  # with LoRA the reference is the base, adapters off
        args=config,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tokenizer(),
        **peft,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--trainer", default="trainer", choices=("trainer", "sft", "dpo", "grpo"))
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA on every projection")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--deepspeed", type=int, default=0)
    parser.add_argument("--lowbit-line", action="store_true", help="the one documented line, for python/torchrun")
    parser.add_argument("--pretrained", default=None, help="a saved model to from_pretrained (with --fsdp)")
    args = parser.parse_args()
    if args.lowbit_line:
        import lowbit

        lowbit.patch_trainer()  # noqa: E702, I001 - the documented line, as a user writes it
    run = trainer(args)
    before = {name: p.detach().float().clone() for name, p in run.model.named_parameters() if p.requires_grad}
    at_start = {}
    if args.pretrained:
        run.add_callback(CheckpointDistance(args.pretrained, at_start))
    reported: list[dict] = []  # what the reporting integrations (TensorBoard, W&B, ...) are given
    run.add_callback(ReportedLogs(reported))
    run.train(resume_from_checkpoint=args.resume)
    write_result(run, before, Path(args.out), at_start, reported)


def checkpoint_distance_class():
    from transformers import TrainerCallback

    class CheckpointDistance(TrainerCallback):
        """At the start of training (after prepare): the largest difference between this rank's
        whole weights and the saved checkpoint's."""

        def __init__(self, path: str, into: dict):
            from safetensors.torch import load_file

            self.saved = load_file(str(Path(path) / "model.safetensors"))
            self.into = into

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            weights = {name: _full(p).detach().float() for name, p in model.named_parameters()}
            common = [name for name in self.saved if name in weights]
            self.into["compared"] = len(common)
            self.into["max_diff"] = max(float((weights[n] - self.saved[n].float()).abs().max()) for n in common)

    return CheckpointDistance


def CheckpointDistance(path: str, into: dict):  # noqa: N802 - builds the callback once transformers is imported
    return checkpoint_distance_class()(path, into)


def ReportedLogs(into: list):  # noqa: N802 - builds the callback once transformers is imported
    """Records each log as the callbacks after lowbit's (the reporting integrations) receive it."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            into.append(dict(logs or {}))

    return Recorder()


def write_result(run, before: dict, out: Path, at_start: dict | None = None, reported: list | None = None) -> None:
    """What the test compares, from this process."""
    acc = run.accelerator
    after = dict(acc.unwrap_model(run.model).named_parameters())
    in_optimizer = sum(len(group["params"]) for group in run.optimizer.param_groups)
    moved = sorted(n for n in before if n in after and not torch.equal(before[n], _full(after[n]).float()))
    history = run.state.log_history
    result = {
        "losses": [h["loss"] for h in history if "loss" in h],
        "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h],
        "log_keys": sorted({k for h in history for k in h}),
        "reported_keys": sorted({k for logs in reported or [] for k in logs}),
        "fp8_gemm_share": next(
            (h["throughput/fp8_gemm_share"] for h in reversed(reported or []) if "throughput/fp8_gemm_share" in h),
            None,
        ),
        "optimizer_params": in_optimizer,
        "trainable_params": len(before),
        "moved": moved,
        "accelerator": f"{type(acc).__module__}.{type(acc).__name__}",
        "mixed_precision": str(acc.mixed_precision),
        "fp8_backend": getattr(acc, "fp8_backend", None),
        "distributed_type": str(acc.distributed_type),
        "checkpoint_distance_at_start": at_start or None,
        "layer_classes": layer_classes(acc.unwrap_model(run.model)),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"result_{acc.process_index}.json").write_text(json.dumps(result))


def layer_classes(model) -> dict[str, dict[str, int]]:
    """How many Linear-like layers of each role ended as each class: adapters (under ``lora_``),
    the layers LoRA wraps (``base_layer``), and the rest."""
    out: dict[str, dict[str, int]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") or not any(k in type(module).__name__ for k in ("Linear", "Conv1D")):
            continue  # PEFT's wrapper (its class is called Linear too) is not a layer of its own
        role = "adapter" if ".lora_" in name else "base" if name.endswith("base_layer") else "other"
        counts = out.setdefault(role, {})
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return out


def _full(tensor):
    """A parameter's whole value on this process (a sharded DTensor gathered)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
