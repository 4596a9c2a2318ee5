"""Accelerate's ``accelerate.utils.memory`` path."""

from lowbit.runtime.training.memory import (  # noqa: F401
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
