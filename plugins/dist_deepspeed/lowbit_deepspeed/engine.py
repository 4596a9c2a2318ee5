"""``deepspeed.initialize`` and the objects lowbit hands back around the engine."""
from __future__ import annotations

from typing import Any

import torch

from lowbit.types import PrepareContext
from lowbit_deepspeed.ds_config import build_config


class EngineOwnedOptimizer(torch.optim.Optimizer):
    """The DeepSpeed optimizer, with ``step``/``zero_grad`` left to the engine.

    ``accelerator.backward`` runs ``engine.backward`` and ``engine.step`` (which steps at the
    accumulation boundary and zeroes gradients), as DeepSpeed requires; so the script's own
    ``optimizer.step()`` and ``zero_grad()`` must not act a second time.
    """

    def __init__(self, ds_optimizer: Any):
        self.optimizer = ds_optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return getattr(self.optimizer, "state", {})

    @property
    def defaults(self):
        return getattr(self.optimizer, "defaults", {})

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)


def _ensure_process_group(context: PrepareContext) -> None:
    """DeepSpeed needs a process group, and the env vars a launcher sets, even for one process
    (a script run with plain ``python``)."""
    import os
    import socket

    import torch.distributed as dist

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "nccl" if context.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def initialize(model, optimizer, context: PrepareContext):
    import deepspeed

    _ensure_process_group(context)
    config = build_config(dict(context.strategy_options), context)
    # An FP8 backend with its own DeepSpeed integration (MS-AMP) supplies the initialize
    # function and its config section; see the strategy_integration hook.
    integration = context.backend_state.get("strategy_integration", {})
    config.update(integration.get("config", {}))
    initialize_fn = integration.get("initialize", deepspeed.initialize)
    engine, ds_optimizer, _, _ = initialize_fn(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine, (EngineOwnedOptimizer(ds_optimizer) if ds_optimizer is not None else None)


def gathered_state_dict(engine) -> dict[str, torch.Tensor]:
    """The full state dict on every rank; under ZeRO-3 the partitioned parameters are gathered."""
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return module.state_dict()
