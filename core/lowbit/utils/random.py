"""Accelerate's ``accelerate.utils.random`` path."""
from lowbit.utils import set_seed, synchronize_rng_states  # noqa: F401
