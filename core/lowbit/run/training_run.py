"""One training run, built from its settings: the object a front (Accelerate's ``Accelerator``,
:mod:`lowbit.compat.accelerator`) builds once and hands every call to.

Built in this order, each step deciding once: the settings (defaults < config file < ACCELERATE_*
< LOWBIT_* env vars < arguments, validated against the installed plugins' option names), the hardware, this process's
place in the job, the plugins (at most one low-precision backend, at most one distributed
strategy), the run's ``Precision``, the parallel layout, and the collaborators that ``prepare()``
and the training step use (preparation, prepared objects, the step's state, the preemption watch,
the throughput meter, checkpoints). Nothing here knows Accelerate's classes: the front translates
its arguments and handler objects into a :class:`RunRequest`.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from lowbit.kernel.errors import ConfigError, did_you_mean
from lowbit.kernel.manager import LowbitPluginManager
from lowbit.kernel.notices import note
from lowbit.kernel.registry import PluginRegistry, Selection
from lowbit.kernel.telemetry import TelemetryRecorder
from lowbit.kernel.types import PrepareContext

from lowbit.runtime.checkpoint.training_state import TrainingStateCheckpointer
from lowbit.runtime.observe.fp8_payoff import slower_layers
from lowbit.runtime.observe.throughput import ThroughputMeter, meter_is_on
from lowbit.runtime.precision import Precision, SlowPrecisionNotice
from lowbit.runtime.process_group import ProcessFacts, process_facts
from lowbit.runtime.routing import ChosenPlugins
from lowbit.runtime.training.data_loader import LoaderOptions
from lowbit.runtime.training.gradient_sync import GradientSync, active_loader, skip_gradient_sync
from lowbit.runtime.training.norm_stats import NormStatsKeeper
from lowbit.runtime.training.preemption import PreemptionWatch
from lowbit.runtime.training.preparation import Preparation, PreparationSettings, unwrap
from lowbit.runtime.training.prepared import PreparedObjects, StepState, TrainingCounters

from lowbit.run.choice import choose_plugins
from lowbit.run.layout import ParallelismConfig, data_parallel_slot, settle_layout
from lowbit.run.plugin_manager import make_plugin_manager
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


@dataclass
class RunRequest:
    """What a front asks of a run, in lowbit's terms."""

    settings: dict[str, Any]  # the settings given as arguments (None: not given, the lower layers decide)
    config_file: str | os.PathLike | None = None
    recipe_handler: Any = None  # the one FP8 recipe object given, or None
    handlers: dict[type, Any] = field(default_factory=dict)  # other handler objects by class (a strategy names its own)
    process_group_options: dict[str, Any] | None = None  # init_process_group's arguments (timeout, backend)
    scaler_options: dict[str, Any] = field(default_factory=dict)  # fp16's GradScaler arguments
    autocast_options: dict[str, Any] = field(default_factory=dict)  # autocast's arguments (cache_enabled)
    layout: ParallelismConfig | None = None
    loaders: LoaderOptions = field(default_factory=LoaderOptions)
    device_placement: bool = True
    step_scheduler_with_optimizer: bool = True
    compile_options: dict[str, Any] | None = None  # torch.compile's options dict, as given
    sync: GradientSync = field(default_factory=GradientSync)  # whether this micro-batch syncs (the front's view)
    # Gradient accumulation: the last batch of a prepared loader ends an accumulation, and whether
    # every micro-batch reduces its gradients (Accelerate's GradientAccumulationPlugin, as values).
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    # A front's own default precision (transformers' Trainer passes its TrainingArguments' every time):
    # below the launcher, the environment and the config file, resolved with the settings in one pass.
    front_precision: str | None = None
    front_name: str = "the script"
    gradient_state: Any = None  # what prepared loaders show as ``.gradient_state``


class TrainingRun:
    """The run's decisions and collaborators; see the module's docstring for the order."""

    def __init__(self, request: RunRequest, plugin_manager: LowbitPluginManager | None = None) -> None:
        # Hardware detection needs use_cpu before the plugins are known; the settings are validated
        # once the plugins' option names are, so fp8_config keys can be checked against them.
        file_layer = read_config_layer(request.config_file)
        self.plugin_manager = plugin_manager or make_plugin_manager()
        self.hardware = self.plugin_manager.detect_hardware(
            cpu=setting_before_plugins("use_cpu", request.settings, file_layer)
        )
        self.registry = PluginRegistry(self.plugin_manager, self.hardware)
        settings = request.settings
        # When the precision asked outside the script overrides the front's default, what to tell
        # the user (the front says it, after its own first line).
        self.front_precision_overridden: str | None = None
        if request.front_precision is not None:
            asked, where = precision_asked_outside(file_layer, os.environ)
            chosen, self.front_precision_overridden = precision_under_front(
                request.front_precision, asked, where, request.front_name
            )
            settings = dict(settings, mixed_precision=chosen)
        self.config: LowbitConfig = self._resolve_settings(settings, file_layer)
        self.facts: ProcessFacts = process_facts(
            self.hardware.device_type,
            self.hardware.device_count,
            request.process_group_options,
            group_of_one=self.config.distributed_type.upper() not in ("NO", "MULTI_CPU"),
        )
        choice = choose_plugins(
            self.registry, self.config, request.recipe_handler, request.handlers, self.facts.num_processes
        )
        self.backend: Selection | None = choice.backend
        self.strategy: Selection | None = choice.strategy
        self.mixed_precision = choice.mixed_precision
        self.precision = Precision.for_run(
            self.mixed_precision,
            self.facts.device,
            self.strategy_owns_precision,
            request.scaler_options,
            request.autocast_options,
        )
        slow = self.precision.slow_reason()
        if slow:
            note(slow, SlowPrecisionNotice)
        self.layout = self._settle_layout(request.layout)
        self.context = PrepareContext(
            hardware=self.hardware,
            mixed_precision=self.mixed_precision,
            device=self.facts.device,
            backend_options=choice.backend_options,
            recipe_runs=choice.recipe.status if choice.recipe else "native",
            strategy=self.strategy.name if self.strategy else "none",
            strategy_options=choice.strategy_options(self.config),
            world_size=self.facts.num_processes,
            rank=self.facts.process_index,
            local_rank=self.facts.local_process_index,
            gradient_accumulation_steps=self.config.gradient_accumulation_steps,
            compiled=str(self.config.dynamo_backend).lower() != "no",
            autocast_dtype=self.precision.autocast_dtype,
            device_mesh=self.layout.device_mesh if self.layout is not None else None,
            parallelism=self.layout,
            predict_slower_layers=slower_layers,
        )
        # The collaborators: each gets what it needs, never the run or the front.
        self.counters = TrainingCounters()
        self.plugins = ChosenPlugins(self.plugin_manager, self.backend, self.strategy, self.context)
        self.prepared = PreparedObjects()
        self.step_state = StepState(
            request.sync,
            self.precision,
            self.facts.num_processes,
            request.loaders.split_batches,
            request.step_scheduler_with_optimizer,
            on_nonfinite_loss=self.config.on_nonfinite_loss,
            check_gradients=not self.strategy_owns_precision,
        )
        self.preparation = Preparation(
            self.plugins, self.prepared, self.step_state, self._preparation_settings(request)
        )
        # A strategy that owns backward (DeepSpeed's engine: its own loss scaling and accumulation),
        # looked up once: backward() calls it, or torch's, with nothing to decide per step.
        self._strategy_backward = self.plugins.caller(self.strategy, "backward")
        self.sync_with_dataloader, self.sync_each_batch = request.sync_with_dataloader, request.sync_each_batch
        self.preemption = PreemptionWatch(self.facts.num_processes)
        self.step_state.every_step.append(self.preemption.after_step)  # polled alike on every rank, skipped or not
        self.norm_stats = NormStatsKeeper()  # BatchNorm's statistics, put back when a step is skipped
        self.step_state.step_observers.append(self.norm_stats.keep)
        self.step_state.undo_on_skip.append(self.norm_stats.restore)
        data_parallel = data_parallel_slot(self.layout, self.facts.num_processes, self.facts.process_index)[0]
        self.throughput = (
            ThroughputMeter(
                self.facts.device,
                data_parallel,
                self.precision,
                self.facts.is_main_process,
                model_parallel=max(self.facts.num_processes // data_parallel, 1),
            )
            if meter_is_on()
            else None
        )
        if self.throughput is not None:
            self.preparation.before_conversion = self.throughput.copy_structure
            self.step_state.step_observers.append(self.throughput.on_step)
        self.checkpointer = TrainingStateCheckpointer(
            self.plugins, self.prepared, self.step_state, self.facts, self.counters
        )
        self.telemetry: TelemetryRecorder | None = None

    # ------------------------------------------------------------------ deciding

    def _resolve_settings(self, given: dict[str, Any], file_layer: tuple[dict[str, Any], str]) -> LowbitConfig:
        fp8_specs = {}
        for cand in self.registry.ranked("backend"):
            if cand.description.options_class is not None:
                fp8_specs.update(cand.description.options_class.option_specs())
        config = resolve_config(
            given, fp8_specs=fp8_specs, file_layer=file_layer, sections=tuple(self.registry.config_sections())
        )
        check_plugin_names(
            config,
            self.registry.precision_names(),
            self.registry.distributed_type_names(),
            where="the settings (argument, env var or config file)",
        )
        _check_dynamo_backend(config.dynamo_backend)
        return config

    @property
    def strategy_owns_precision(self) -> bool:
        """Whether the strategy runs precision itself (DeepSpeed's engine: its own loss scaling and overflow checks)."""
        return self.strategy is not None and self.strategy.chosen.description.owns_precision

    def _settle_layout(self, given: ParallelismConfig | None) -> ParallelismConfig | None:
        strategy = self.strategy.chosen if self.strategy else None
        others = {c.name: c.description.mesh_dims for c in self.registry.ranked("strategy")}
        return settle_layout(
            given,
            self.config.section(PARALLELISM_SECTION),
            "the settings",
            self.facts.num_processes,
            self.facts.device.type,
            strategy.name if strategy else "none",
            strategy.description.mesh_dims if strategy else (),
            others,
        )

    def _preparation_settings(self, request: RunRequest) -> PreparationSettings:
        config, loaders = self.config, request.loaders
        batches, batch_index = data_parallel_slot(self.layout, self.facts.num_processes, self.facts.process_index)
        given = {
            "mode": config.dynamo_mode,
            "fullgraph": config.dynamo_use_fullgraph,
            "dynamic": config.dynamo_use_dynamic,
            "options": request.compile_options,
        }
        return PreparationSettings(
            device=self.facts.device,
            data_parallel_size=batches,
            data_parallel_rank=batch_index,
            loaders=loaders,
            device_placement=request.device_placement,
            dynamo_backend=config.dynamo_backend,
            compile_options={k: v for k, v in given.items() if v is not None},
            regional_compilation=bool(config.dynamo_use_regional_compilation),
            gradient_state=request.gradient_state,
        )

    # ------------------------------------------------------------------ what a front reads of the run

    @property
    def backend_name(self) -> str | None:
        return self.backend.name if self.backend is not None else None

    @property
    def strategy_reports_as(self) -> str | None:
        """The Accelerate DistributedType name the chosen strategy reports itself as (None: no strategy)."""
        return self.strategy.chosen.description.reports_as if self.strategy is not None else None

    @property
    def device_mesh(self) -> Any:
        return self.layout.device_mesh if self.layout is not None else None

    def context_parallel_rotation(self) -> str | None:
        """How context parallelism passes keys and values around the ranks (None: it is off)."""
        if self.layout is None or not self.layout.cp_enabled:
            return None
        return self.layout.cp_handler.cp_comm_strategy

    def plugins_trackers(self) -> list[dict[str, type]]:
        """The experiment trackers each installed plugin registers, by name."""
        return [trackers for _plugin, trackers in self.plugin_manager.call_each("register_trackers")]

    def prepare_for_evaluation(self, model: torch.nn.Module, place: bool = True) -> torch.nn.Module:
        return self.preparation.prepare_for_evaluation(model, place=place)

    def preemption_requested(self) -> bool:
        return self.preemption.requested()

    def on_preemption(self, callback: Callable[[], None]) -> None:
        self.preemption.listen()
        self.preemption.callbacks.append(callback)

    def throughput_figures(self) -> dict[str, float]:
        """The last optimizer step's figures (empty before the first step, or with the meter off)."""
        return dict(self.throughput.latest) if self.throughput is not None else {}

    def set_batch_tokens(self, tokens: int) -> None:
        if self.throughput is not None:
            self.throughput.set_batch_tokens(tokens)

    def fp8_stats_rows(self) -> list[Any] | None:
        """The latest sampled FP8 numerics, one row per layer and tensor (None: telemetry is off)."""
        if self.telemetry is None:
            return None
        self.telemetry.read_pending()
        return sorted(self.telemetry.layers.values(), key=lambda s: s.layer)

    # ------------------------------------------------------------------ checkpoints

    def register_for_checkpointing(self, *objects: Any) -> None:
        self.checkpointer.register(*objects)

    def add_checkpoint_hook(self, when: str, hook: Callable[..., None]) -> Any:
        """``hook`` run at the start of every ``save_state`` (``when="save"``) or ``load_state``; the
        handle's ``remove()`` unregisters it."""
        from torch.utils.hooks import RemovableHandle

        hooks = self.checkpointer.save_pre_hooks if when == "save" else self.checkpointer.load_pre_hooks
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def refuse_nonfinite_weights(self) -> None:
        self.checkpointer.refuse_nonfinite_weights()

    def save_state(self, output_dir: Any) -> Any:
        return self.checkpointer.save(output_dir)

    def load_state(self, input_dir: Any, allow_precision_change: bool = False) -> None:
        self.checkpointer.load(input_dir, allow_precision_change=allow_precision_change)

    # ------------------------------------------------------------------ the training loop's verbs

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided for gradient accumulation and scaled for fp16. A strategy that
        owns backward (DeepSpeed's engine) gets the undivided loss: it divides by its own steps."""
        self.preemption.at_iteration_start()  # a loop that feeds its own batches ends its iteration here
        model = self.prepared.models[0] if self.prepared.models else None
        if model is None and self.backend is not None:
            raise ConfigError(
                "backward() on an fp8 Accelerator, but no model was prepared, so nothing ran in FP8. "
                "Pass the model through accelerator.prepare(model, optimizer, ...) before training."
            )
        if self._strategy_backward is not None and self._strategy_backward(
            context=self.context, loss=loss, model=model, options=kwargs
        ):
            return
        # Read at the optimizer step (one host sync per step, none here): on_nonfinite_loss decides.
        self.step_state.observe_finite(loss)
        steps = self.config.gradient_accumulation_steps
        self.precision.backward(loss / steps if steps > 1 else loss, **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-batch: gradients sync and optimizers step every N-th call, and on the last batch
        of a prepared dataloader (so an epoch never ends with gradients left over)."""
        self.counters.step += 1
        loader = active_loader()
        at_end = self.sync_with_dataloader and bool(getattr(loader, "end_of_dataloader", False))
        sync = self.step_state.gradient_sync
        sync.sync_gradients = self.counters.step % self.config.gradient_accumulation_steps == 0 or at_end
        with contextlib.ExitStack() as stack:
            # A strategy that owns backward (DeepSpeed) counts micro-batches itself; sync_each_batch
            # reduces every micro-batch's gradients (under FSDP2 no unsharded gradients pile up).
            if not (sync.sync_gradients or self.sync_each_batch or self._strategy_backward is not None):
                for model in models:
                    skip_gradient_sync(model, stack)
            yield

    @contextlib.contextmanager
    def autocast(self, settings: dict[str, Any] | None = None) -> Iterator[None]:
        """The contexts a prepared model's forward runs in, for code outside ``forward``; ``settings``
        (autocast's arguments) replace the run's inside this block."""
        factories = [self.precision.autocast_factory(settings), self.plugins.backend_context_factory(None)]
        with contextlib.ExitStack() as stack:
            for factory in factories:
                if factory is not None:
                    stack.enter_context(factory())
            yield

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch steps the optimizers (its gradients are whole)."""
        return self.step_state.gradient_sync.sync_gradients

    def unscale_gradients(self, optimizers: list[Any]) -> None:
        """fp16: bring the optimizers' scaled gradients back to their true size, once per optimizer
        step, and only on the micro-batch that steps: unscaled earlier, they would be summed with the
        scaled gradients of the micro-batches after (GradScaler's own rule: once per step)."""
        if self.precision.scaler is not None and not self.sync_gradients:
            raise ConfigError(
                "fp16: gradients unscaled (unscale_gradients, clip_grad_norm_ or clip_grad_value_) on a micro-batch "
                "that does not step (gradient accumulation, "
                f"{self.config.gradient_accumulation_steps} micro-batches a step): the micro-batches still to come "
                "would add scaled gradients to unscaled ones. Clip on the step's last micro-batch: `if "
                "accelerator.sync_gradients: accelerator.clip_grad_norm_(...)`, as in Accelerate's examples."
            )
        for optimizer in optimizers:
            self.precision.unscale_gradients(getattr(optimizer, "optimizer", optimizer))

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by total norm, unscaling fp16 gradients first. The total norm comes free
        here: a NaN/inf gradient counts as a NaN/inf loss does (a strategy that owns precision,
        DeepSpeed, handles its own overflows)."""
        self.unscale_gradients(self.prepared.optimizers)
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        norm = self.plugins.clip_grad_norm(parameters, max_norm, norm_type)
        norm = norm if norm is not None else torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if torch.is_tensor(norm) and not self.strategy_owns_precision:
            # FSDP2 returns the norm as a (replicated) DTensor: its plain value is what the step checks.
            plain = norm.full_tensor() if callable(getattr(norm, "full_tensor", None)) else norm
            self.step_state.observe_finite(plain, clipped=parameters)
        return norm

    @contextlib.contextmanager
    def join(self, joinables: list[Any], joining: bool) -> Iterator[None]:
        """``join_uneven_inputs``' block: torch's ``Join`` over the user's DDP models and lowbit's
        optimizer step (a rank out of batches shadows the step's collectives). Inside it, a
        preemption save runs at the step that agreed it, on every rank alike: a joined rank has
        no next iteration at which the others' saves could find it."""
        from torch.distributed.algorithms.join import Join

        from lowbit.runtime.training.joining import OptimizerStepShadow

        def shadow_step() -> None:  # one step's collectives, in the order a step runs them
            self.step_state.shadow_finite_agreement()
            self.preemption.after_step()

        shadows = [OptimizerStepShadow(shadow_step, self.facts.device, joinables)] if self.prepared.optimizers else []
        self.preemption.at_the_step = joining
        try:
            with Join([*joinables, *shadows], enable=joining, throw_on_early_termination=False):
                yield
        finally:
            self.preemption.at_the_step = False

    def forget_prepared(self) -> None:
        """``free_memory()``: every prepared object dropped, and what the run kept of them."""
        self.prepared.clear()
        self.norm_stats.forget()

    def set_even_batches(self, even: bool) -> None:
        """Loaders prepared from now on fill up (or leave short) the last round of batches."""
        self.preparation.settings.loaders.even_batches = even

    def explain_backend_choice(self) -> str:
        """Why this backend: every installed backend with its priority and reason to decline."""
        if self.backend is None:
            unused = Selection(
                "backend",
                None,
                None,
                "ranking",
                self.registry.ranked("backend"),
                self.hardware,
                list(self.plugin_manager.broken),
            )
            return (
                f"mixed_precision={self.mixed_precision!r}: torch's own autocast and loss scaling; no "
                f"low-precision backend in use (they train mixed_precision='fp8' or 'fp4').\n{unused.explain()}"
            )
        return self.backend.explain()

    # ------------------------------------------------------------------ preparing and watching

    def prepare(self, *objects: Any) -> Any:
        """``Preparation.prepare``, then the watchers wired to what it prepared."""
        result = self.preparation.prepare(*objects)
        self._observe_what_was_prepared()
        return result

    def _observe_what_was_prepared(self) -> None:
        """Each prepared dataloader tells the preemption watch when an iteration ends, and the
        throughput meter its batches; the meter counts the FLOPs of the first prepared model once,
        after the first optimizer step (nothing in its forward)."""
        for loader in self.prepared.dataloaders:
            loader.at_iteration_start = self.preemption.at_iteration_start
        if self.step_state.checks_nonfinite:
            for model in self.prepared.models:
                self.norm_stats.watch(unwrap(model))
        # weakly: the step state the run owns must not keep it alive (a cycle outlives `del`)
        self.step_state.explain_nonfinite = _called_weakly(self._nonfinite_origin)
        self.step_state.nonfinite_buffers = _called_weakly(self._nonfinite_buffers)
        meter = self.throughput
        if meter is None:
            return
        for loader in self.prepared.dataloaders:
            if loader.observe_batch is None:
                loader.observe_batch = meter.on_batch
        if self.prepared.models:
            report = self.prepared.conversion_reports.get(unwrap(self.prepared.models[0]))
            meter.converted([*report.converted, *report.frozen_low_precision] if report is not None else ())

    def _nonfinite_buffers(self) -> list[str]:
        from lowbit.runtime.checkpoint.finite_weights import nonfinite_buffers

        return [name for model in self.prepared.models for name in nonfinite_buffers(unwrap(model))]

    def _nonfinite_origin(self) -> str | None:
        """Where a non-finite step's NaN/inf began: the last batch of the loop's prepared dataloader
        replayed on the first prepared model (lowbit.runtime.observe.nonfinite_origin)."""
        from lowbit.runtime.observe.nonfinite_origin import find_nonfinite_origin
        from lowbit.runtime.training.gradient_sync import active_loader

        loader = active_loader() or (self.prepared.dataloaders[-1] if self.prepared.dataloaders else None)
        batch = getattr(loader, "last_batch", None)
        if not self.prepared.models:
            return None
        if batch is None:
            return (
                "not replayed: no batch came through a prepared dataloader (Ray Data's iterators, or a loop that "
                "feeds tensors itself)"
            )
        model = unwrap(self.prepared.models[0], keep_fp32_wrapper=True)
        # One process replays alone only with whole weights it runs itself (DDP's module, not a
        # sharded one, whose forward gathers from every rank, nor an engine that runs the model).
        if self.strategy_owns_precision or any(callable(getattr(p, "to_local", None)) for p in model.parameters()):
            return f"not replayed under {self.context.strategy} (its weights are sharded, or its engine runs the model)"
        return find_nonfinite_origin(model, batch)

    def start_telemetry(self, model: torch.nn.Module, recorder: TelemetryRecorder) -> bool:
        """Have the backend record FP8 numerics of ``model`` into ``recorder`` after each optimizer
        step (replacing any recorder before); False when the backend cannot."""
        if not self.plugins.enable_fp8_telemetry(model, recorder):
            return False
        self.stop_telemetry()
        self.telemetry = recorder
        self.step_state.step_observers.append(recorder.next_step)
        return True

    def stop_telemetry(self) -> None:
        if self.telemetry is not None:
            self.telemetry.remove()
            self.step_state.step_observers.remove(self.telemetry.next_step)
            self.telemetry = None


def _called_weakly(method: Callable[[], Any]) -> Callable[[], Any]:
    """``method()`` through a weak reference to its object (None once the object is gone)."""
    weak = weakref.WeakMethod(method)

    def call() -> Any:
        bound = weak()
        return None if bound is None else bound()

    return call


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
