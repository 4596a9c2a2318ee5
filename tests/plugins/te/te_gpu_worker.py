"""One rank of test_te_gpu.py's 2-GPU tests: fp8 with the real TE, rank-specific data.

Writes rank<N>.json: strategy, backend, losses, a hash of the weights and the first TE layer's
forward amax history (which TE reduces over the data-parallel group)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch import nn

from lowbit import Accelerator
from lowbit.cli.self_test import train_steps
from lowbit.utils import TERecipeKwargs


def main(out: Path) -> None:
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(recipe="delayed")])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator(device="cuda").manual_seed(100 + accelerator.process_index)  # different per rank
    x = torch.randn(64, 256, device=accelerator.device, generator=generator) * (1 + accelerator.process_index)
    y = torch.randn(64, 256, device=accelerator.device, generator=generator)
    losses = train_steps(accelerator, model, optimizer, x, y, 20)  # the loss averaged over ranks
    first_te = next(m for m in accelerator.unwrap_model(model).modules() if hasattr(m, "fp8_meta"))
    amax = (
        first_te.fp8_meta["scaling_fwd"].amax_history.float().cpu().tolist()
        if "scaling_fwd" in first_te.fp8_meta
        else None
    )
    state = accelerator.get_state_dict(model)
    digest = hashlib.sha256()
    for name in sorted(state):
        if torch.is_tensor(state[name]):
            digest.update(state[name].float().cpu().numpy().tobytes())
    result = {
        "strategy": accelerator.distributed_strategy,
        "fp8_backend": accelerator.fp8_backend,
        "losses": losses,
        "amax": amax,
        "weights_sha": digest.hexdigest(),
    }
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
