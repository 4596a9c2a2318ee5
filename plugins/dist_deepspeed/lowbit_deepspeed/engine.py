"""``deepspeed.initialize`` and the objects lowbit hands back around the engine."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch

from lowbit.kernel.plugin_api import PrepareContext

from lowbit_deepspeed.ds_config import build_config


@dataclasses.dataclass
class DeepSpeedRunState:
    """lowbit-deepspeed's state for one run (``context.plugin_state(DeepSpeedRunState)``): the
    engine, and the boundary step the last backward left for ``optimizer.step()``."""

    engine: Any = None
    pending_step: Any = None


def run_state(context: PrepareContext) -> DeepSpeedRunState:
    return context.plugin_state(DeepSpeedRunState)


def run_pending_step(context: PrepareContext) -> bool:
    """Take the engine step that the last backward left for the script's ``optimizer.step()``
    (or ``clip_grad_norm_``); True when there was one."""
    state = run_state(context)
    engine, state.pending_step = state.pending_step, None
    if engine is None:
        return False
    engine.step()
    return True


class EngineOwnedOptimizer(torch.optim.Optimizer):
    """The DeepSpeed optimizer, stepped through the engine.

    ``accelerator.backward`` runs ``engine.backward``, and ``engine.step`` at once between
    accumulation boundaries (DeepSpeed counts micro-steps there); the step at a boundary waits
    for the script's ``optimizer.step()``, so that ``accelerator.clip_grad_norm_`` called before
    it can still clip. ``zero_grad()`` is the engine's business. ``step_was_skipped`` is the
    engine's verdict on its last boundary step (a loss-scale overflow in fp16, an inf/NaN gradient
    in bf16 ZeRO): lowbit's step reports it and the LR schedule holds, as DeepSpeed's own does.
    """

    def __init__(self, ds_optimizer: Any, context: PrepareContext):
        self.optimizer = ds_optimizer
        self._context = context

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return getattr(self.optimizer, "state", {})

    @property
    def defaults(self):
        return getattr(self.optimizer, "defaults", {})

    @property
    def step_was_skipped(self) -> bool:
        engine = run_state(self._context).engine
        return engine is not None and not engine.was_step_applied()

    def step(self, closure=None):
        run_pending_step(self._context)
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


@contextlib.contextmanager
def _without_shared_memory_kernels(device: torch.device) -> Iterator[None]:
    """On CPU, keep DeepSpeed from compiling its shared-memory collectives at startup.

    DeepSpeed's torch communication backend builds a C++ extension (``deepspeed_shm_comm``) with
    the system compiler when it is created on CPU: 30-150 s on a 2-core machine, again in every
    new virtual environment, and it fails without a compiler. Only DeepSpeed's inference
    all-reduce (tensor-parallel inference) uses it; training's collectives go through
    ``torch.distributed`` either way. So its builder reports "no kernel" while lowbit creates the
    backend. ``LOWBIT_DEEPSPEED_SHM_COMM=1`` keeps DeepSpeed's own behaviour.
    """
    import importlib
    import os

    # not ``import deepspeed.comm.torch as ...``: that name resolves to the ``torch`` that
    # ``deepspeed.comm`` re-exports, not to the submodule
    ds_comm = importlib.import_module("deepspeed.comm.torch")

    keep = device.type != "cpu" or os.environ.get("LOWBIT_DEEPSPEED_SHM_COMM") == "1"
    if keep or not hasattr(ds_comm, "build_shm_op"):
        yield
        return
    original = ds_comm.build_shm_op
    ds_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm.build_shm_op = original


def initialize(model, optimizer, context: PrepareContext):
    import deepspeed

    _ensure_process_group(context)
    config = build_config(dict(context.strategy_options), context)
    # An FP8 backend with its own DeepSpeed integration (MS-AMP) supplies the initialize
    # function and its config section; see the strategy_integration hook.
    integration = context.strategy_integration
    config.update(integration.config)
    initialize_fn = integration.initialize or deepspeed.initialize
    with _without_shared_memory_kernels(context.device):
        engine, ds_optimizer, _, _ = initialize_fn(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )
    run_state(context).engine = engine
    return engine, (EngineOwnedOptimizer(ds_optimizer, context) if ds_optimizer is not None else None)


def clip_and_step(engine, max_norm: float, context: PrepareContext) -> torch.Tensor:
    """``clip_grad_norm_`` under DeepSpeed: the boundary step runs now, clipped at ``max_norm``.

    DeepSpeed clips inside its step, with the value of ``gradient_clipping``; that value is set to
    the caller's ``max_norm`` first (in the engine's config and in its ZeRO / bf16 optimizer,
    which copied it at creation). The returned norm is the one DeepSpeed computed before
    clipping. Without ZeRO and in fp32 the gradients are plain ``.grad`` tensors, clipped here.
    """
    plain = not (engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())
    norm = None
    if plain and run_state(context).pending_step is not None:
        norm = torch.nn.utils.clip_grad_norm_([p for p in engine.module.parameters() if p.grad is not None], max_norm)
    with _clipping_at(engine, float(max_norm)):  # this step only: later steps and checkpoints keep the config's value
        stepped = run_pending_step(context)
    if stepped and norm is None:
        norm = engine.get_global_grad_norm()
    if norm is None:  # not at an accumulation boundary: the norm of the last step taken
        norm = engine.get_global_grad_norm() or 0.0
    return norm.detach() if torch.is_tensor(norm) else torch.tensor(float(norm))


@contextlib.contextmanager
def _clipping_at(engine, max_norm: float) -> Iterator[None]:
    """DeepSpeed's clipping value set to ``max_norm`` for one step, then put back."""
    saved_config = engine._config.gradient_clipping
    has_copy = hasattr(engine.optimizer, "clip_grad")
    saved_copy = engine.optimizer.clip_grad if has_copy else None
    engine._config.gradient_clipping = max_norm
    if has_copy:
        engine.optimizer.clip_grad = max_norm
    try:
        yield
    finally:
        engine._config.gradient_clipping = saved_config
        if has_copy:
            engine.optimizer.clip_grad = saved_copy


def gathered_state_dict(engine, main: bool) -> dict[str, torch.Tensor]:
    """The full state dict. Under ZeRO-3 it is consolidated on the main process only (``main``): the
    partitioned parameters are gathered one module at a time (every rank takes part) and only the main
    process copies them to the CPU, so the peak is the largest layer on each GPU and one model in the
    main process's RAM. A parameter two modules share (tied embeddings) is copied once, under both names."""
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() != 3:
        return module.state_dict()
    full: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        with deepspeed.zero.GatheredParameters(list(sub.parameters(recurse=False)), modifier_rank=None):
            if not main:
                continue
            own: dict[str, Any] = {}
            sub._save_to_state_dict(own, f"{prefix}." if prefix else "", keep_vars=True)
            for key, value in own.items():
                if torch.is_tensor(value) and id(value) not in copies:
                    copies[id(value)] = value.detach().to("cpu", copy=True)
                full[key] = copies[id(value)] if torch.is_tensor(value) else value
    return full
