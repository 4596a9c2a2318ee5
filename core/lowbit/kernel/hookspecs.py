"""The plugin contract: every hook lowbit calls, who calls it, when, and what it must return.

A plugin is a module (or object) with functions marked ``@lowbit.hookimpl`` whose names match
the specs below. A hookimpl may accept any subset of a spec's arguments.

Routing: only ``describe_backend``, ``detect_hardware``, the launcher hooks and
``register_trackers`` are broadcast to every plugin. All other hooks are *routed*: lowbit calls
them on the one chosen low-precision backend or the one chosen distributed strategy, never on the
others, so each has one answer and none is ``firstresult``
(``detect_hardware`` is: the first detector to answer wins). A routed hook that a plugin does not
implement falls back to the default stated in its docstring.

"Called by" names the run's method that makes the call (``TrainingRun`` in
:mod:`lowbit.run.training_run`), the one every front hands to: Accelerate's ``Accelerator.X``,
transformers' Trainer through it, or a front of a plugin's own.

Importing this module must never import torch or any backend library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager

import pluggy

if TYPE_CHECKING:
    import argparse

    import torch

    from lowbit.kernel.layer_roles import LayerRoles
    from lowbit.kernel.types import ConvertedModel, HardwareInfo, PluginDescription, PrepareContext, StrategyIntegration

PROJECT_NAME = "lowbit"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------- discovery


@hookspec(firstresult=True)  # the first detector to answer wins: a third-party one before the built-in
def detect_hardware(cpu: bool) -> HardwareInfo | None:
    """Report the device this process trains on.

    Called by: the run's construction (``TrainingRun()``), ``lowbit plugins`` and ``lowbit env``, once each.
    ``cpu`` is True when the user forced CPU (``Accelerator(cpu=True)`` / ``--cpu``).
    Return a :class:`~lowbit.kernel.types.HardwareInfo`, or None to let the next plugin decide.
    The built-in detector (CUDA, else CPU) runs last, so a third-party detector wins.
    """


@hookspec
def describe_backend(hardware: HardwareInfo) -> PluginDescription | None:
    """Describe the backend this plugin offers and whether it can run on ``hardware``.

    Called by: the plugin manager, on every plugin, each call isolated in its own try/except,
    when a backend must be chosen and by ``lowbit plugins``.
    Return the record of the plugin's role: a :class:`~lowbit.kernel.types.BackendDescription` (a
    low-precision backend) or :class:`~lowbit.kernel.types.StrategyDescription` (a distributed strategy),
    with an integer ``priority`` (higher wins;
    msamp 300 > te 200 > ao 100) and,
    when unavailable, a ``reason`` a person can act on ("msamp not importable: ...").
    Must be cheap: check with ``importlib.util.find_spec`` and package metadata, never by
    importing the backend library. Raising marks the plugin broken; the others keep working.
    """


# --------------------------------------------------------------------------- routed: low-precision backend


@hookspec
def check_compatibility(context: PrepareContext) -> None:
    """Refuse a combination the backend cannot run, before anything is changed.

    Called by: ``TrainingRun.prepare`` on the chosen low-precision backend and the chosen strategy,
    first, with the full context (precision, strategy, world size).
    Raise :class:`~lowbit.kernel.errors.UnsupportedCombinationError` with a clear message
    (e.g. "MS-AMP does not support ZeRO-3"). Return None when the combination is fine.
    """


@hookspec
def convert_model(
    model: torch.nn.Module, context: PrepareContext, layer_roles: LayerRoles
) -> torch.nn.Module | ConvertedModel | None:
    """Swap the model's layers for the backend's low-precision layers.

    Called by: ``TrainingRun.prepare``, on the chosen low-precision backend only, once per model,
    before the model is moved into any distributed wrapper.
    ``context.backend_options`` holds the resolved recipe kwargs. ``layer_roles`` says, once for
    every backend, what each Linear is (:mod:`lowbit.kernel.layer_roles`): an adapter (never
    converted: prepare refuses a conversion that touched one), a frozen base (its weight needs no
    gradient: convert it with no weight-gradient GEMM, or leave it and say why), a layer
    published in FP8 (use its own scales, or leave it and say why), or a trained Linear. Return the converted model
    (it may be the same object, modified in place), or ``ConvertedModel(model,
    ConversionReport(converted=[...], skipped={name: why}))`` to say what the conversion took
    (``prepare`` prints it; ``fp8_report()`` returns it in words). Default: the model unchanged.
    """


@hookspec
def wrap_optimizer(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, context: PrepareContext
) -> torch.optim.Optimizer | None:
    """Replace or wrap the optimizer, e.g. with one that keeps FP8 states.

    Called by: ``TrainingRun.prepare``, on the chosen low-precision backend only, once per optimizer,
    after ``convert_model`` (``model`` is the converted model when one was prepared in the same
    call, else None). Return the optimizer to use. Default: the optimizer unchanged.
    """


@hookspec
def prepare_model_and_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, context: PrepareContext, layer_roles: LayerRoles
) -> tuple[torch.nn.Module, torch.optim.Optimizer | None] | None:
    """Convert model and optimizer together, for backends whose API takes both at once.
    ``layer_roles`` as for ``convert_model``: adapters are never converted.

    Called by: ``TrainingRun.prepare``, on the chosen low-precision backend, in place of
    ``convert_model`` + ``wrap_optimizer`` when it is implemented (``msamp.initialize``).
    Return ``(model, optimizer)``; the returned objects are what the user gets back.
    Return None to fall back to ``convert_model`` and ``wrap_optimizer``.
    """


@hookspec
def autocast_context(model: torch.nn.Module | None, context: PrepareContext) -> Callable[[], ContextManager] | None:
    """Give the backend's forward context (e.g. TE's ``autocast``) as a *context factory*: a
    function of no arguments that returns a fresh context manager.

    Called by: ``TrainingRun.prepare``, once per model, on the chosen low-precision backend (and by
    ``Accelerator.autocast``, once per block, with ``model=None``). Decide everything here; the
    returned function is called on every forward, inside the run's native autocast (built by
    lowbit's ``Precision``), so keep it plain torch: no plugin lookups, no host syncs, nothing
    ``torch.compile`` cannot trace. Read ``model.training`` inside it if eval must differ.
    Return None for "no context".
    """


@hookspec
def after_optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, context: PrepareContext
) -> Callable[[], None] | None:
    """Give the per-step bookkeeping to run after each real (not skipped) optimizer step, as a
    function of no arguments.

    Called by: ``TrainingRun.prepare``, once per optimizer, on the chosen low-precision backend.
    The returned function runs after every real step (e.g. torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``), and once more after ``load_state`` replaced the
    weights (on every rank), so that nothing derived from the old weights survives. Return None
    when this run has no such work (decided now: the step then pays nothing).
    """


@hookspec
def clip_grad_norm(
    parameters: list[torch.Tensor], max_norm: float, norm_type: float, context: PrepareContext
) -> torch.Tensor | None:
    """Clip gradients where torch's ``clip_grad_norm_`` cannot: gradients of a type it does not
    handle (MS-AMP's ScalingTensor), or held by a strategy that clips inside its own step
    (DeepSpeed's ZeRO partitions).

    Called by: ``TrainingRun.clip_grad_norm_``, after fp16 gradients were unscaled: on the
    distributed strategy first, then on the chosen low-precision backend. Return the total norm (before
    clipping); None passes to the next, and finally to ``torch.nn.utils.clip_grad_norm_``.
    """


@hookspec
def strategy_integration(strategy: str, context: PrepareContext) -> StrategyIntegration | None:
    """Let the low-precision backend take part in the distributed strategy's own setup.

    Called by: ``TrainingRun.prepare``, on the chosen low-precision backend, before
    ``wrap_for_distribution``; the result is ``context.strategy_integration`` for the strategy
    to read: a :class:`~lowbit.kernel.types.StrategyIntegration`. The DeepSpeed strategy reads
    its ``initialize`` (a drop-in for ``deepspeed.initialize``, e.g. ``msamp.deepspeed.initialize``)
    and ``config`` (merged into the DeepSpeed config); the built-in strategies read
    ``tensor_parallel_style`` (how tensor parallelism lays out one of the backend's converted
    modules) and ``activation_checkpoint`` (a drop-in for ``torch.utils.checkpoint.checkpoint``, e.g.
    ``te.distributed.checkpoint``). Return None for "nothing to add".
    """


@hookspec
def enable_fp8_telemetry(model: torch.nn.Module, recorder: Any, context: PrepareContext) -> bool | None:
    """Start reporting FP8 numerics of the model's FP8 layers to ``recorder``.

    Called by: ``TrainingRun.enable_fp8_telemetry``, on the chosen low-precision backend, once. Install
    hooks that call ``recorder.record(layer_name, role, tensor, fp8_dtype, scale)`` for the
    tensors the backend casts ("input", "weight", "grad_output"), with the scale it uses; skip
    the work when ``recorder.active`` is False. Append each hook handle to
    ``recorder.removers``. Return True; a backend that cannot observe its casts leaves this hook
    out, and lowbit says "not supported".
    """


@hookspec
def export_state_dict(
    model: torch.nn.Module, state_dict: dict[str, Any], context: PrepareContext
) -> dict[str, Any] | None:
    """Map a converted model's state dict back to the plain model's names and tensors.

    Called by: ``TrainingRun.save_model``, on the chosen low-precision backend, after the strategy has
    gathered a full state dict. Drop FP8 metadata (it belongs in ``save_state``), turn tensor
    subclasses into plain tensors. Return the new dict. Default: unchanged.
    """


@hookspec
def encode_checkpoint_state(
    kind: str, owner: Any, state: dict[str, Any], context: PrepareContext
) -> dict[str, Any] | None:
    """Make a state dict that ``save_state`` writes readable with ``torch.load(weights_only=True)``.

    Called by: ``TrainingRun.save_state``, on the chosen low-precision backend, for each prepared model
    (``kind="model"``, ``owner`` the unwrapped model) and optimizer (``kind="optimizer"``) whose
    state lowbit writes itself (not when a strategy saves its own, as DeepSpeed does). Turn
    objects that are not tensors or plain data (MS-AMP's ScalingTensor) into tensors and plain
    data. Return the new dict; None leaves it unchanged.
    """


@hookspec
def decode_checkpoint_state(
    kind: str, owner: Any, state: dict[str, Any], context: PrepareContext
) -> dict[str, Any] | None:
    """Undo :func:`encode_checkpoint_state` before the state is loaded.

    Called by: ``TrainingRun.load_state``, on the chosen low-precision backend, with what was read back,
    before ``owner.load_state_dict``. Return the dict to load; None loads it unchanged.
    """


@hookspec
def backend_checkpoint_state(model: torch.nn.Module, context: PrepareContext) -> dict[str, Any] | None:
    """The backend's own state for a prepared model that is not in its state dict.

    Called by: ``TrainingRun.save_state``, on the chosen low-precision backend, on the main process, for
    each prepared model (unwrapped), whatever the strategy. Return tensors and plain data (they
    are read back with ``torch.load(weights_only=True)``), e.g. Transformer Engine's amax
    histories; None when there is nothing to save.
    """


@hookspec
def load_backend_checkpoint_state(
    model: torch.nn.Module, state: dict[str, Any], context: PrepareContext
) -> bool | None:
    """Restore what :func:`backend_checkpoint_state` returned.

    Called by: ``TrainingRun.load_state``, on the chosen low-precision backend, on every process, after the
    model's state dict was loaded. Return True when restored.
    """


# --------------------------------------------------------------------------- routed: distributed strategy


@hookspec
def wrap_for_distribution(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, context: PrepareContext
) -> tuple[torch.nn.Module | None, torch.optim.Optimizer | None] | None:
    """Wrap the (already converted) model and optimizer for multi-process training.

    Called by: ``TrainingRun.prepare``, on the chosen strategy, after the conversion and before
    forward autocast wrapping. Return ``(model, optimizer)``. Default: both unchanged. An optimizer
    whose engine may decline a step (a loss-scale overflow) says so by a ``step_was_skipped``
    property, read after each step: lowbit then reports the skip and holds the LR schedule.
    """


@hookspec
def backward(
    loss: torch.Tensor, model: torch.nn.Module | None, context: PrepareContext, options: dict[str, Any]
) -> bool | None:
    """Run the backward pass when the strategy owns it (DeepSpeed's ``engine.backward``).

    Called by: ``TrainingRun.backward``, on the chosen strategy. ``loss`` is not divided by the
    gradient-accumulation steps (a strategy that owns backward divides by its own). ``options``:
    the keyword arguments the script gave ``accelerator.backward`` (transformers' Trainer passes
    DeepSpeed's ``scale_wrt_gas=False``). Return True when handled; None lets lowbit call
    ``loss.backward()`` (with loss scaling for fp16).
    """


@hookspec
def full_state_dict(model: torch.nn.Module, context: PrepareContext) -> dict[str, Any] | None:
    """Gather the model's complete, unsharded state dict into the main process (rank 0 writes it).

    Called by: ``TrainingRun.save_model`` and ``TrainingRun.full_state_dict``, on the chosen strategy,
    on every rank together. Return the full ``{name: tensor}`` dict on the main process; a strategy
    that shards may return ``{}`` on the others (a whole model on each would need its memory on
    each). None means ``model.state_dict()`` is already full.
    """


@hookspec
def save_checkpoint(directory: str, model: torch.nn.Module, optimizer: Any, context: PrepareContext) -> bool | None:
    """Write the strategy's own checkpoint into ``directory`` (DeepSpeed's ``save_checkpoint``).

    Called by: ``TrainingRun.save_state``, on the chosen strategy, on every rank.
    Return True when the strategy saved model and optimizer itself; None lets lowbit do it.
    """


@hookspec
def load_checkpoint(directory: str, model: torch.nn.Module, optimizer: Any, context: PrepareContext) -> bool | None:
    """Read back what ``save_checkpoint`` wrote into ``directory``.

    Called by: ``TrainingRun.load_state``, on the chosen strategy, on every rank, when the
    checkpoint's metadata says the strategy saved it. Return True when handled, None otherwise.
    """


# --------------------------------------------------------------------------- launcher


@hookspec
def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's own ``lowbit launch`` flags (e.g. ``--fp8_format``, ``--zero_stage``).

    Called by: ``lowbit launch`` on every plugin, each isolated, before parsing. Put the flags
    in an argument group named after the plugin; default them to None so the config file and
    env vars can fill them. Must not import torch or a backend library. Return None.
    """


@hookspec
def launch_environment(args: argparse.Namespace) -> dict[str, str] | None:
    """Turn the plugin's parsed launch flags into env vars for the training processes.

    Called by: ``lowbit launch`` on every plugin, after parsing. Return e.g.
    ``{"LOWBIT_FP8_FP8_FORMAT": "E4M3"}``, only for flags that were given.
    """


# --------------------------------------------------------------------------- experiment tracking


@hookspec
def register_trackers() -> dict[str, type] | None:
    """Offer experiment trackers for ``Accelerator(log_with=...)``.

    Called by: the run, on every plugin, each isolated, when the front asks for trackers (``log_with``).
    Return ``{"name": TrackerClass}`` where each class subclasses ``lowbit.compat.tracking.GeneralTracker``
    (``__init__(run_name, logging_dir, **init_kwargs)``, ``store_init_configuration``, ``log``,
    ``finish``); import the tracker's library inside the class, not at module level.
    """
