"""What one training run decided, once, when it was built: a frozen record.

:func:`plan_run` decides, in this order, each step once: the settings (defaults < config file <
ACCELERATE_* < LOWBIT_* env vars < arguments, validated against the installed plugins' option
names), the hardware, this process's place in the job, the plugins (at most one low-precision
backend, at most one distributed strategy), the run's ``Precision``, the parallel layout, and the
``PrepareContext`` the plugins' hooks are handed. :class:`lowbit.run.training_run.TrainingRun`
wires its parts from the plan and never writes it: every field is frozen, the settings and the
context included. What ``prepare()`` learns later (the first loader's batch size, the backend's
integration with the strategy) goes into the context handed to the hooks from then on, a new
record (``ChosenPlugins.context``), not into the plan. The one change Accelerate allows after
construction, a new accumulation count (transformers' Trainer sets it), makes a new plan.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from lowbit.kernel.errors import ConfigError, did_you_mean
from lowbit.kernel.manager import LowbitPluginManager
from lowbit.kernel.notices import note
from lowbit.kernel.registry import PluginRegistry, Selection
from lowbit.kernel.types import HardwareInfo, PrepareContext

from lowbit.runtime.observe.fp8_payoff import slower_layers
from lowbit.runtime.precision import Precision, SlowPrecisionNotice
from lowbit.runtime.process_group import ProcessFacts, process_facts

from lowbit.run.choice import choose_plugins
from lowbit.run.layout import ParallelismConfig, settle_layout
from lowbit.run.settings import (
    PARALLELISM_SECTION,
    LowbitConfig,
    check_plugin_names,
    precision_asked_outside,
    precision_under_front,
    read_config_layer,
    resolve_config,
    setting_before_plugins,
)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One run's decisions (see the module's docstring); nothing writes them after :func:`plan_run`."""

    config: LowbitConfig
    hardware: HardwareInfo
    registry: PluginRegistry  # the installed plugins, ranked for this hardware
    facts: ProcessFacts
    backend: Selection | None
    strategy: Selection | None
    mixed_precision: str  # as asked, or the fp8_fallback taken
    precision: Precision
    layout: ParallelismConfig | None
    context: PrepareContext
    # When the precision asked outside the script overrode the front's default, what to tell the
    # user (the front says it, after its own first line).
    front_precision_overridden: str | None = None

    @property
    def strategy_owns_precision(self) -> bool:
        """Whether the strategy runs precision itself (DeepSpeed's engine: its own loss scaling and overflow checks)."""
        return _owns_precision(self.strategy)

    def with_accumulation_steps(self, steps: int) -> RunPlan:
        """This plan with another accumulation count (in its settings and its context)."""
        return dataclasses.replace(
            self,
            config=dataclasses.replace(self.config, gradient_accumulation_steps=steps),
            context=dataclasses.replace(self.context, gradient_accumulation_steps=steps),
        )


def plan_run(request: Any, plugin_manager: LowbitPluginManager) -> RunPlan:
    """Decide everything a run decides from its request (a ``RunRequest``), once."""
    # Hardware detection needs use_cpu before the plugins are known; the settings are validated
    # once the plugins' option names are, so fp8_config keys can be checked against them.
    # The config file and the environment, each read once: every layer below reads this snapshot.
    file_layer = read_config_layer(request.config_file)
    environ = dict(os.environ)
    hardware = plugin_manager.detect_hardware(
        cpu=setting_before_plugins("use_cpu", request.settings, file_layer, environ)
    )
    registry = PluginRegistry(plugin_manager, hardware)
    settings, overridden = request.settings, None
    if request.front_precision is not None:
        asked, where = precision_asked_outside(file_layer, environ)
        chosen, overridden = precision_under_front(request.front_precision, asked, where, request.front_name)
        settings = dict(settings, mixed_precision=chosen)
    config = _resolve_settings(registry, settings, file_layer, environ)
    facts = process_facts(
        hardware.device_type,
        hardware.device_count,
        request.process_group_options,
        group_of_one=config.distributed_type.upper() not in ("NO", "MULTI_CPU"),
    )
    choice = choose_plugins(registry, config, request.recipe_handler, request.handlers, facts.num_processes)
    precision = Precision.for_run(
        choice.mixed_precision,
        facts.device,
        _owns_precision(choice.strategy),
        request.scaler_options,
        request.autocast_options,
    )
    slow = precision.slow_reason()
    if slow:
        note(slow, SlowPrecisionNotice)
    layout = _settle_layout(registry, config, facts, choice.strategy, request.layout)
    context = PrepareContext(
        hardware=hardware,
        mixed_precision=choice.mixed_precision,
        device=facts.device,
        backend_options=choice.backend_options,
        recipe_runs=choice.recipe.status if choice.recipe else "native",
        strategy=choice.strategy.name if choice.strategy else "none",
        strategy_options=choice.strategy_options(config),
        world_size=facts.num_processes,
        rank=facts.process_index,
        local_rank=facts.local_process_index,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        compiled=str(config.dynamo_backend).lower() != "no",
        autocast_dtype=precision.autocast_dtype,
        device_mesh=layout.device_mesh if layout is not None else None,
        parallelism=layout,
        predict_slower_layers=slower_layers,
    )
    return RunPlan(
        config=config,
        hardware=hardware,
        registry=registry,
        facts=facts,
        backend=choice.backend,
        strategy=choice.strategy,
        mixed_precision=choice.mixed_precision,
        precision=precision,
        layout=layout,
        context=context,
        front_precision_overridden=overridden,
    )


def _owns_precision(strategy: Selection | None) -> bool:
    return strategy is not None and strategy.chosen.description.owns_precision


def _resolve_settings(
    registry: PluginRegistry, given: dict[str, Any], file_layer: tuple[dict[str, Any], str], environ: dict[str, str]
) -> LowbitConfig:
    fp8_specs = {}
    for cand in registry.ranked("backend"):
        if cand.description.options_class is not None:
            fp8_specs.update(cand.description.options_class.option_specs())
    config = resolve_config(
        given, environ=environ, fp8_specs=fp8_specs, file_layer=file_layer, sections=tuple(registry.config_sections())
    )
    check_plugin_names(
        config,
        registry.precision_names(),
        registry.distributed_type_names(),
        where="the settings (argument, env var or config file)",
    )
    _check_dynamo_backend(config.dynamo_backend)
    return config


def _settle_layout(
    registry: PluginRegistry,
    config: LowbitConfig,
    facts: ProcessFacts,
    strategy: Selection | None,
    given: ParallelismConfig | None,
) -> ParallelismConfig | None:
    chosen = strategy.chosen if strategy else None
    others = {c.name: c.description.mesh_dims for c in registry.ranked("strategy")}
    return settle_layout(
        given,
        config.section(PARALLELISM_SECTION),
        "the settings",
        facts.num_processes,
        facts.device.type,
        chosen.name if chosen else "none",
        chosen.description.mesh_dims if chosen else (),
        others,
    )


def _check_dynamo_backend(backend: str | None) -> None:
    """A typo in the torch.compile backend is an error now, not at the first forward."""
    if backend is None or backend.lower() == "no":
        return
    import torch._dynamo

    names = torch._dynamo.list_backends(exclude_tags=())
    if backend.lower() not in names:
        raise ConfigError(
            f"dynamo_backend {backend!r} is not a torch.compile backend here.{did_you_mean(backend.lower(), names)} "
            f"Available: {', '.join(sorted(names))}, or 'no' to not compile."
        )
