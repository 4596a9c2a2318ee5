"""lowbit-zero-ddp: a third-party distributed strategy, found through its entry point.

DistributedDataParallel for the model, and torch's ``ZeroRedundancyOptimizer`` around the user's
optimizer, so each rank keeps only its shard of the optimizer state (ZeRO stage 1 without
DeepSpeed). The built-in strategies do not do this. Choose it by name, like a built-in one:
``distributed_type: ZERO_DDP`` (or ``zero_ddp``) in a config file, ``LOWBIT_DISTRIBUTED_TYPE``,
``lowbit launch --distributed_type zero_ddp`` or ``lowbit launch --use_zero_ddp``.

Its state is saved its own way (``save_checkpoint``): the sharded optimizer state is first
gathered to rank 0, which writes it with the model; every rank reads it back and keeps its shard.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from lowbit.kernel.plugin_api import HardwareInfo, PrepareContext, StrategyDescription, hookimpl

NAME = "zero_ddp"
OPTIONS = ("parameters_as_bucket_view",)
MODEL_FILE, OPTIMIZER_FILE = "zero_ddp_model.pt", "zero_ddp_optimizer.pt"


@hookimpl
def describe_backend(hardware: HardwareInfo) -> StrategyDescription:
    return StrategyDescription(
        name=NAME,
        priority=1,
        available=True,
        distributed_types=("ZERO_DDP",),
        reports_as="MULTI_GPU",  # data parallel, as Accelerate's scripts understand it
        config_section="zero_ddp_config",  # {"parameters_as_bucket_view": true}
        launch_flag="use_zero_ddp",
        checkpoint="own",
    )


@hookimpl
def check_compatibility(context: PrepareContext) -> None:
    from lowbit.kernel.plugin_api import ConfigError

    unknown = sorted(set(context.strategy_options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"zero_ddp_config keys {unknown} are not options of zero_ddp; it takes {list(OPTIONS)}.")


def _sharded(optimizer: Any, options: dict[str, Any]) -> Any:
    """The same optimizer class, settings and parameter groups, its state sharded across ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **options, **defaults)


@hookimpl
def wrap_for_distribution(model, optimizer, context: PrepareContext):
    from torch.nn.parallel import DistributedDataParallel

    if model is not None:
        device_ids = [context.device.index or 0] if context.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    if optimizer is not None:
        optimizer = _sharded(optimizer, dict(context.strategy_options))
    return model, optimizer


def _inner(model: Any) -> Any:
    return getattr(model, "module", model)


@hookimpl
def save_checkpoint(directory: str, model, optimizer, context: PrepareContext):
    import torch

    if optimizer is not None:
        optimizer.consolidate_state_dict(to=0)  # a collective: every rank takes part
    if context.rank == 0:
        torch.save(_inner(model).state_dict(), Path(directory) / MODEL_FILE)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), Path(directory) / OPTIMIZER_FILE)
    return True


@hookimpl
def load_checkpoint(directory: str, model, optimizer, context: PrepareContext):
    import torch

    _inner(model).load_state_dict(
        torch.load(Path(directory) / MODEL_FILE, map_location=context.device, weights_only=True)
    )
    if optimizer is not None:
        optimizer.load_state_dict(
            torch.load(Path(directory) / OPTIMIZER_FILE, map_location=context.device, weights_only=True)
        )
    return True
