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


def initialize(model, optimizer, context: PrepareContext):
    import deepspeed

    config = build_config(dict(context.strategy_options), context)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine, (EngineOwnedOptimizer(ds_optimizer) if ds_optimizer is not None else None)


def gathered_state_dict(engine) -> dict[str, torch.Tensor]:
    """The full state dict on every rank; under ZeRO-3 the partitioned parameters are gathered."""
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return module.state_dict()
