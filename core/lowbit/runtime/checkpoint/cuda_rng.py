"""Restoring the GPUs' random state from a checkpoint (lowbit's own and Accelerate's)."""
from __future__ import annotations

import torch


def set_cuda_rng_states(states: list[torch.Tensor]) -> None:
    """Each visible GPU's RNG state from a save's list, one per GPU the saving process saw. A rank
    may see fewer GPUs now (each process given one GPU by CUDA_VISIBLE_DEVICES, or the job moved):
    the GPUs it sees take the first states; the others' states have no GPU to go to."""
    if not torch.cuda.is_available():
        return
    for index, saved in enumerate(list(states)[:torch.cuda.device_count()]):
        torch.cuda.set_rng_state(saved, index)
