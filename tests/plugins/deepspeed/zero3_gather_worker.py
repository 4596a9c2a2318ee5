"""One process under DeepSpeed ZeRO-3 (test_deepspeed.py): ``get_state_dict`` must gather one layer at a
time, and ``clip_grad_norm_`` must leave DeepSpeed's own clipping as configured. Prints one JSON line.

    LOWBIT_DISTRIBUTED_TYPE=DEEPSPEED LOWBIT_DEEPSPEED_CONFIG='{"zero_stage": 3, "gradient_clipping": 1.0}' \\
        python tests/plugins/deepspeed/zero3_gather_worker.py
"""

import json

import deepspeed
import torch
from torch import nn

from lowbit import Accelerator

from lowbit_deepspeed.engine import DeepSpeedRunState

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
reference = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
acc = Accelerator(mixed_precision="bf16")
model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
gathered = []
original = deepspeed.zero.GatheredParameters


def recording(params, *args, **kwargs):
    gathered.append(sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params))
    return original(params, *args, **kwargs)


deepspeed.zero.GatheredParameters = recording
state = acc.get_state_dict(model)
deepspeed.zero.GatheredParameters = original
engine = acc._run.context.plugin_state(DeepSpeedRunState).engine
acc.backward(model(torch.randn(4, 16)).float().pow(2).mean())
norm = acc.clip_grad_norm_(model.parameters(), 0.5)
optimizer.step()
print(
    json.dumps(
        {
            "full": {
                k: [list(v.shape), torch.equal(v.to(torch.bfloat16), reference[k]), v.device.type]
                for k, v in state.items()
            },
            "largest_gather": max(gathered),
            "largest_layer": largest,
            "total": sum(reference[k].numel() for k in reference),
            "clipping_after": [engine._config.gradient_clipping, getattr(engine.optimizer, "clip_grad", None)],
        }
    )
)
