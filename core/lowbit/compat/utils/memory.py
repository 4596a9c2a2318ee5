"""Accelerate's ``accelerate.utils.memory`` path."""
from lowbit.runtime.training.memory import clear_device_cache, find_executable_batch_size, release_memory  # noqa: F401

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory"]
