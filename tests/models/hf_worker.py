"""A tiny Hugging Face model trained the way a user's script does, under whatever `lowbit launch`
chose (or in one process when run with plain python). Every rank writes what the test compares.

    lowbit launch --cpu --num_processes 2 [--use_fsdp | --use_deepspeed --zero_stage N] \
        hf_worker.py {llama,gpt2}-{bf16,fp8}[,...] OUT_DIR

Each run (model and precision) in turn, with an Accelerator of its own, in OUT_DIR/RUN/.

Data: arithmetic token sequences (learnable in a few steps). Global batch 8 whatever the number
of processes, gradient accumulation 2, SGD with momentum (so clipping shows in the first update:
the weights move by lr x max_norm when the gradient was clipped), a linear schedule (transformers'),
``clip_grad_norm_`` at every optimizer step. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from lowbit import Accelerator

GLOBAL_BATCH = 8
SEQUENCES = 64
SEQ_LEN = 32
VOCAB = 128
LR = 0.3
MAX_NORM = 0.5


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=SEQ_LEN,
                tie_word_embeddings=False,
            )
        )
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=SEQ_LEN,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def sequences() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (SEQUENCES, 1), generator=g)
    step = torch.randint(1, 4, (SEQUENCES, 1), generator=g)
    return (start + step * torch.arange(SEQ_LEN)) % VOCAB


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].float().numpy().tobytes())
    return h.hexdigest()


def train(run: str, out: Path) -> Accelerator:
    model_name, precision = run.split("-")
    from transformers import get_linear_schedule_with_warmup

    acc = Accelerator(mixed_precision=precision, gradient_accumulation_steps=2)
    model = build_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    # A prepared scheduler steps once per process per optimizer step (as in Accelerate, where the
    # per-process batch is fixed): scale the schedule so every strategy sees the same lr per step.
    steps = SEQUENCES // GLOBAL_BATCH * acc.num_processes
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=steps)
    micro_batch = GLOBAL_BATCH // 2 // acc.num_processes  # accumulation 2: 8 sequences per optimizer step
    loader = torch.utils.data.DataLoader(sequences(), batch_size=micro_batch)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    before = {k: v.float() for k, v in acc.get_state_dict(model).items()}
    losses, norms, updates = [], [], []
    for ids in loader:
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(acc.gather(loss.detach()).mean().item())
        if acc.sync_gradients and not updates:  # the first update is lr x the clipped gradient
            after = {k: v.float() for k, v in acc.get_state_dict(model).items()}
            # Under FSDP2 / ZeRO-3 only the main process holds the gathered weights (others: {}).
            updates.append(sum(((after[k] - before[k]) ** 2).sum() for k in before).item() ** 0.5 if before else None)
            before = after
    state = acc.get_state_dict(model)
    acc.save_model(model, out / "model")
    result = {
        "strategy": acc.distributed_strategy,
        "fp8_backend": acc.fp8_backend,
        "fp8_report": acc.fp8_report(),
        "losses": losses,
        "norms": norms,
        "updates": updates,
        "lr": LR,
        "max_norm": MAX_NORM,
        "digest": digest(state) if state else None,
    }
    (out / f"result_rank{acc.process_index}.json").write_text(json.dumps(result))
    return acc


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import run_scenarios

    runs = []
    run_scenarios(lambda run, out: runs.append(train(run, out)))
    runs[-1].end_training()
