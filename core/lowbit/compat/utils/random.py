"""Accelerate's ``accelerate.utils.random`` path: seeding, and one random state for every process."""

from __future__ import annotations

import os
import random as _random  # Python's (this module shares its name)
from typing import Any

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy (when installed) and torch; ``device_specific`` adds the process index."""
    import torch

    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    _random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_states(rng_types: list[Any], generator: Any = None) -> None:
    """Give every process the main process's random state for each of ``rng_types`` ("torch",
    "cuda", "generator": ``generator``'s), so that they draw the same numbers from here on."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for kind in (str(getattr(t, "value", t)).lower() for t in rng_types):
        if kind == "torch":
            states = [torch.get_rng_state()]
        elif kind == "cuda":
            states = [torch.cuda.get_rng_state()] if torch.cuda.is_available() else []
        elif kind == "generator":
            states = [generator.get_state()] if generator is not None else []
        else:
            raise ValueError(f"rng_types: {kind!r} is not one of torch, cuda, generator.")
        if not states:
            continue
        dist.broadcast_object_list(states, src=0)
        {
            "torch": torch.set_rng_state,
            "cuda": lambda s: torch.cuda.set_rng_state(s),
            "generator": lambda s: generator.set_state(s),
        }[kind](states[0])


def synchronize_rng_state(rng_type: Any = None, generator: Any = None) -> None:
    """``synchronize_rng_states`` for one generator kind ("torch", "cuda" or "generator")."""
    if rng_type is not None:
        synchronize_rng_states([rng_type], generator)
