"""lowbit: FP8 / BF16 / FP16 training for plain PyTorch scripts.

    from lowbit import Accelerator
    accelerator = Accelerator(mixed_precision="fp8")

Public names are loaded lazily so that ``import lowbit`` (and ``lowbit --help``) stays free of
torch until something that needs it is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowbit.kernel import notices as _notices
from lowbit.kernel.hookspecs import hookimpl

_notices.install()  # lowbit's notices print as one line: "lowbit: note: ..." (still real warnings)

# Public name -> module that defines it (Accelerate's top-level names included).
_LAZY = {
    "__version__": "lowbit.kernel.version",  # read from the distribution's metadata: 20 ms, so only when asked
    "Accelerator": "lowbit.compat.accelerator",
    "PartialState": "lowbit.compat.state",
    "AcceleratorState": "lowbit.compat.state",
    "GradientState": "lowbit.compat.state",
    "DistributedType": "lowbit.compat.state",
    "find_executable_batch_size": "lowbit.runtime.training.memory",
    "skip_first_batches": "lowbit.runtime.training.loader_shards",
    "ParallelismConfig": "lowbit.run.layout",
    "debug_launcher": "lowbit.compat.launchers",
    "notebook_launcher": "lowbit.compat.launchers",
    "init_empty_weights": "lowbit.compat.big_modeling",
    "init_on_device": "lowbit.compat.big_modeling",
    # Big-model inference dispatch: importable, and each raises saying what to use (lowbit trains).
    **{
        name: "lowbit.compat.big_modeling"
        for name in (
            "cpu_offload",
            "cpu_offload_with_hook",
            "disk_offload",
            "dispatch_model",
            "infer_auto_device_map",
            "load_checkpoint_and_dispatch",
            "load_checkpoint_in_model",
        )
    },
    # transformers' Trainer and TRL's trainers on lowbit's Accelerator (what `lowbit launch` does for a script)
    "patch_trainer": "lowbit.integrations.transformers.patch",
    "unpatch_trainer": "lowbit.integrations.transformers.patch",
    "synchronize_rng_states": "lowbit.compat.utils",
    "is_rich_available": "lowbit.compat.utils",
    # The handler classes Accelerate also exports at its top level.
    **{
        name: "lowbit.compat.handlers"
        for name in (
            "AutocastKwargs",
            "DataLoaderConfiguration",
            "DDPCommunicationHookType",
            "DeepSpeedPlugin",
            "DistributedDataParallelKwargs",
            "FullyShardedDataParallelPlugin",
            "GradScalerKwargs",
            "InitProcessGroupKwargs",
            "ProfileKwargs",
        )
    },
}
__all__ = [*_LAZY, "hookimpl"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads them lazily
    from lowbit.compat.accelerator import Accelerator  # noqa: F401
    from lowbit.compat.state import AcceleratorState, DistributedType, GradientState, PartialState  # noqa: F401


# Accelerate's submodules that lowbit has under the same name (``lowbit.compat.logging``, ...), loaded on first use.
SUBMODULES = (
    "accelerator",
    "state",
    "utils",
    "logging",
    "tracking",
    "parallelism_config",
    "big_modeling",
    "launchers",
    "data_loader",
    "optimizer",
    "scheduler",
    "hooks",
    "inference",
    "test_utils",
)


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in SUBMODULES:
        return importlib.import_module(f"lowbit.{name}")
    from lowbit.compat.accelerate_names import NOT_OFFERED_AT_TOP_LEVEL

    if name in NOT_OFFERED_AT_TOP_LEVEL:
        from lowbit.kernel.errors import UnsupportedCombinationError

        raise UnsupportedCombinationError(f"lowbit.{name}: {NOT_OFFERED_AT_TOP_LEVEL[name]}.")
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
