"""Import torchao without the start-up lines that do not concern this machine.

On import, torchao tries to load each of its compiled kernel libraries and logs a warning for
each one that does not load, and torch logs a deprecation notice for each Enum torchao
registers. On a machine without a CUDA GPU the libraries that fail are the GPU-only kernels
(``_C_mxfp8``, ``_C_cutlass_90a``: Blackwell MXFP8 and Hopper CUTLASS), so their warnings say
nothing the user can act on, and they come from every rank. Only those records are dropped, and
only during lowbit's import of torchao: anything else torchao or torch logs still shows.
"""

from __future__ import annotations

import logging
import sys

GPU_ONLY_LIBRARIES = ("_C_mxfp8", "_C_cutlass_90a")
ENUM_NOTICE = "is an Enum subclass and is now natively supported by torch.compile"


class _HarmlessStartupLines(logging.Filter):
    def __init__(self, gpu_present: bool) -> None:
        super().__init__()
        self.gpu_present = gpu_present

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Failed to load") and any(lib in message for lib in GPU_ONLY_LIBRARIES):
            return self.gpu_present  # on a GPU machine a missing kernel may matter: keep it
        return ENUM_NOTICE not in message


def import_torchao(module: str = "torchao"):
    """``import torchao`` (or one of its modules: the MX prototype registers more Enums), quietly
    the first time (see the module docstring)."""
    import importlib

    if module in sys.modules:
        return sys.modules[module]
    import torch

    quiet = _HarmlessStartupLines(gpu_present=torch.cuda.is_available())
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        return importlib.import_module(module)
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
