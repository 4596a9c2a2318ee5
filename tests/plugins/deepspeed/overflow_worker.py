"""One process under DeepSpeed ZeRO-2 in bf16 (test_deepspeed.py): a step whose gradients hold inf
(the loss finite: an overflow in backward) is skipped by DeepSpeed's own check; lowbit must report it
(``step_was_skipped``) and hold the LR schedule, as on a step it skipped itself. Prints one JSON line.

    LOWBIT_DISTRIBUTED_TYPE=DEEPSPEED LOWBIT_DEEPSPEED_CONFIG='{"zero_stage": 2}' \\
        python tests/plugins/deepspeed/overflow_worker.py
"""

import json

import torch
from torch import nn

from lowbit import Accelerator

torch.manual_seed(0)
acc = Accelerator(mixed_precision="bf16")
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
overflow = {"now": False}
first_weight = next(p for p in model.parameters())
# A hook makes one step's gradient inf while its loss stays finite (lowbit's own loss check passes).
first_weight.register_hook(lambda grad: grad * float("inf") if overflow["now"] else grad)
steps = []
for step in range(3):
    overflow["now"] = step == 1
    loss = model(torch.randn(4, 8)).float().pow(2).mean()
    before = first_weight.detach().float().clone()
    acc.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    steps.append(
        {
            "finite_loss": bool(torch.isfinite(loss)),
            "skipped": optimizer.step_was_skipped,
            "accelerator_says": acc.optimizer_step_was_skipped,
            "lr": scheduler.get_last_lr()[0],
            "weights_moved": not torch.equal(before, first_weight.detach().float()),
        }
    )
print(json.dumps({"steps": steps}))
