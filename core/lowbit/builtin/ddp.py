"""Built-in strategy: DistributedDataParallel over the process group torchrun set up."""
from __future__ import annotations

from lowbit.hookspecs import hookimpl
from lowbit.types import BackendDescription, HardwareInfo, PrepareContext

NAME = "ddp"


@hookimpl
def describe_backend(hardware: HardwareInfo) -> BackendDescription:
    return BackendDescription(name=NAME, kind="distributed", priority=10, available=True, aliases=("multi_gpu", "multi_cpu"))


@hookimpl
def wrap_for_distribution(model, optimizer, context: PrepareContext):
    if model is None:
        return model, optimizer
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [context.device.index or 0] if context.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **context.strategy_options), optimizer
