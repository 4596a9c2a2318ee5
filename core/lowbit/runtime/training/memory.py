"""Finding a batch size that fits, and giving memory back (Accelerate's ``find_executable_batch_size``)."""

from __future__ import annotations

import functools
import gc
import inspect
from typing import Any, Callable

import torch

# Messages of the errors that mean "this batch does not fit in memory".
_OUT_OF_MEMORY = (
    "CUDA out of memory",
    "out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_ALLOC_FAILED",
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Give the device allocator's cached, unused memory back (CUDA), after collecting garbage if asked."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop the given references, collect garbage and empty the CUDA cache; returns Nones to
    assign back: ``model, optimizer = release_memory(model, optimizer)``."""
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    clear_device_cache(garbage_collection=True)
    return objects


def should_reduce_batch_size(exc: BaseException) -> bool:
    return (
        isinstance(exc, (RuntimeError, MemoryError))
        and any(m in str(exc) for m in _OUT_OF_MEMORY)
        or isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ()))
    )


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[int], int] | None = None,
) -> Callable[..., Any]:
    """Decorate ``function(batch_size, ...)``: call it with ``starting_batch_size``, multiplying the
    batch size by 0.9 (as Accelerate does) after each out-of-memory error, until it runs or the
    size reaches 0. ``reduce_batch_size_fn(size) -> smaller size`` replaces the 0.9 rule."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    shrink = reduce_batch_size_fn or (lambda size: int(size * 0.9))

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            raise TypeError(
                f"{function.__name__} gets its batch size from find_executable_batch_size as its first argument; "
                f"call it without that argument, e.g. {function.__name__}({', '.join(params[1:])})."
            )
        batch_size = starting_batch_size
        while True:
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found: even a batch size of 1 ran out of memory.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried
                if not should_reduce_batch_size(exc):
                    raise
                release_memory()
                batch_size = shrink(batch_size)

    return run
