"""The GPUs' random state in a checkpoint (lowbit's own and Accelerate's), restored to the right GPU.

A save keeps the state of every GPU the process saw, by position, and lowbit's also the state of
the process's own GPU (the one its ranks' kernels drew from). A process that sees the GPUs as at
the save gets each back by position. One that sees others (each process given one GPU by
CUDA_VISIBLE_DEVICES, or the job moved to other GPUs) gets its own GPU's saved state on the GPU it
uses now: by position it took GPU 0's, another rank's stream.
"""

from __future__ import annotations

from typing import Any

import torch


def cuda_rng_state() -> dict[str, Any]:
    """What a save keeps: every visible GPU's state, and this process's own GPU's (none without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    return {"cuda": torch.cuda.get_rng_state_all(), "cuda_own": torch.cuda.get_rng_state(torch.cuda.current_device())}


def set_cuda_rng_states(states: list[torch.Tensor], own: torch.Tensor | None = None) -> None:
    """Restore the saved GPUs' states: by position when this process sees as many GPUs as the save
    did; else its own GPU's saved state (``own``) on the GPU it uses now, or, for a save that has
    none (Accelerate's), the first states on the GPUs it sees."""
    if not torch.cuda.is_available():
        return
    states = list(states)
    count = torch.cuda.device_count()
    if own is not None and len(states) != count:
        torch.cuda.set_rng_state(own, torch.cuda.current_device())
        return
    for index, saved in enumerate(states[:count]):
        torch.cuda.set_rng_state(saved, index)
