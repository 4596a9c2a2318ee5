"""One training run, built from its settings: the object a front (Accelerate's ``Accelerator``,
:mod:`lowbit.compat.accelerator`) builds once and hands every call to.

Built in two parts: the plan (:mod:`lowbit.run.plan`: the settings, the hardware, this process's
place in the job, the plugins, the run's ``Precision``, the parallel layout and the hooks' context,
each decided once, frozen), and the parts wired from it that ``prepare()`` and the training loop's
verbs use (preparation, prepared objects, the step's state, the preemption watch, the throughput
meter, checkpoints). Nothing here knows Accelerate's classes: the front translates its arguments
and handler objects into a :class:`RunRequest`.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from lowbit.kernel.errors import ConfigError, UnsupportedCombinationError
from lowbit.kernel.manager import LowbitPluginManager
from lowbit.kernel.notices import note
from lowbit.kernel.registry import Selection
from lowbit.kernel.telemetry import FP8StatsTable, TelemetryRecorder
from lowbit.kernel.types import PrepareContext

from lowbit.runtime.checkpoint import automatic as automatic_checkpoint
from lowbit.runtime.checkpoint import model_files
from lowbit.runtime.checkpoint.files import write_file_atomically
from lowbit.runtime.checkpoint.finite_weights import refuse_nonfinite_weights
from lowbit.runtime.checkpoint.training_state import TrainingStateCheckpointer
from lowbit.runtime.observe.fp8_report import conversion_report
from lowbit.runtime.observe.throughput import ThroughputMeter, meter_is_on
from lowbit.runtime.process_group import every_rank_must_arrive, wait_for_everyone
from lowbit.runtime.routing import ChosenPlugins
from lowbit.runtime.training.data_loader import LoaderOptions
from lowbit.runtime.training.gradient_sync import GradientSync, active_loader, skip_gradient_sync
from lowbit.runtime.training.norm_stats import NormStatsKeeper
from lowbit.runtime.training.preemption import PreemptionWatch
from lowbit.runtime.training.preparation import Preparation, PreparationSettings, unwrap
from lowbit.runtime.training.prepared import PreparedObjects, StepState, TrainingCounters

from lowbit.run.layout import ParallelismConfig, data_parallel_slot
from lowbit.run.plan import RunPlan, plan_run
from lowbit.run.plugin_manager import make_plugin_manager


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
    # Where automatically named checkpoints go, and how many stay (Accelerate's ProjectConfiguration:
    # project_dir, automatic_checkpoint_naming, total_limit, iteration).
    project: Any = None


class TrainingRun:
    """The run's decisions and collaborators; see the module's docstring for the order."""

    def __init__(self, request: RunRequest, plugin_manager: LowbitPluginManager | None = None) -> None:
        self.plugin_manager = plugin_manager or make_plugin_manager()
        self.plan: RunPlan = plan_run(request, self.plugin_manager)
        plan, facts = self.plan, self.plan.facts
        # The collaborators: each gets what it needs, never the run or the front.
        self.counters = TrainingCounters()
        self.plugins = ChosenPlugins(self.plugin_manager, plan.backend, plan.strategy, plan.context)
        self.prepared = PreparedObjects()
        self.step_state = StepState(
            request.sync,
            plan.precision,
            facts.num_processes,
            request.loaders.split_batches,
            request.step_scheduler_with_optimizer,
            on_nonfinite_loss=plan.config.on_nonfinite_loss,
            check_gradients=not plan.strategy_owns_precision,
        )
        self.preparation = Preparation(
            self.plugins, self.prepared, self.step_state, self._preparation_settings(request)
        )
        # A strategy that owns backward (DeepSpeed's engine: its own loss scaling and accumulation),
        # looked up once: backward() calls it, or torch's, with nothing to decide per step.
        self._strategy_backward = self.plugins.caller(plan.strategy, "backward")
        self.sync_with_dataloader, self.sync_each_batch = request.sync_with_dataloader, request.sync_each_batch
        self.preemption = PreemptionWatch(facts.num_processes)
        self.step_state.every_step.append(self.preemption.after_step)  # polled alike on every rank, skipped or not
        self.norm_stats = NormStatsKeeper()  # BatchNorm's statistics, put back when a step is skipped
        self.step_state.step_observers.append(self.norm_stats.keep)
        self.step_state.undo_on_skip.append(self.norm_stats.restore)
        data_parallel = data_parallel_slot(plan.layout, facts.num_processes, facts.process_index)[0]
        self.throughput = (
            ThroughputMeter(
                facts.device,
                data_parallel,
                plan.precision,
                facts.is_main_process,
                model_parallel=max(facts.num_processes // data_parallel, 1),
            )
            if meter_is_on()
            else None
        )
        if self.throughput is not None:
            self.preparation.before_conversion = self.throughput.copy_structure
            self.step_state.step_observers.append(self.throughput.on_step)
        self.checkpointer = TrainingStateCheckpointer(
            self.plugins, self.prepared, self.step_state, facts, self.counters
        )
        self.telemetry: TelemetryRecorder | None = None
        self.project = request.project

    # ------------------------------------------------------------------ the hooks' context

    @property
    def context(self) -> PrepareContext:
        """The context the plugins' hooks are handed now: the plan's, with what ``prepare()`` learned."""
        return self.plugins.context

    def _preparation_settings(self, request: RunRequest) -> PreparationSettings:
        config, loaders = self.plan.config, request.loaders
        batches, batch_index = data_parallel_slot(
            self.plan.layout, self.plan.facts.num_processes, self.plan.facts.process_index
        )
        given = {
            "mode": config.dynamo_mode,
            "fullgraph": config.dynamo_use_fullgraph,
            "dynamic": config.dynamo_use_dynamic,
            "options": request.compile_options,
        }
        return PreparationSettings(
            device=self.plan.facts.device,
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
        return self.plan.backend.name if self.plan.backend is not None else None

    @property
    def strategy_reports_as(self) -> str | None:
        """The Accelerate DistributedType name the chosen strategy reports itself as (None: no strategy)."""
        return self.plan.strategy.chosen.description.reports_as if self.plan.strategy is not None else None

    @property
    def device_mesh(self) -> Any:
        return self.plan.layout.device_mesh if self.plan.layout is not None else None

    def mesh_rank(self, dim: str) -> int:
        """This process's index along ``dim`` of the layout's mesh; 0 when that dimension is off."""
        if self.plan.layout is None:
            raise ConfigError(
                f"No parallel layout: pass Accelerator(parallelism_config=ParallelismConfig(...)) to have a {dim} rank."
            )
        return self.plan.layout.device_mesh.get_local_rank(dim) if getattr(self.plan.layout, f"{dim}_size") > 1 else 0

    @contextlib.contextmanager
    def context_parallel(self, buffers: Any, buffer_seq_dims: Any, no_restore_buffers: Any) -> Iterator[None]:
        """Split ``buffers`` along their sequence dimension over the context-parallel ranks for the
        block (torch's ``context_parallel``); nothing, with a note, when context parallelism is off."""
        if self.plan.layout is None or not self.plan.layout.cp_enabled:
            note("maybe_context_parallel does nothing: context parallelism is off (cp_size is 1).")
            yield
            return
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(self.plan.layout.cp_handler.cp_comm_strategy)
        mesh = self.plan.layout.device_mesh["cp"]
        with context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers
        ):
            yield

    def plugins_trackers(self) -> dict[str, type]:
        """The experiment trackers the installed plugins register, by name."""
        registered: dict[str, type] = {}
        for _plugin, trackers in self.plugin_manager.call_each("register_trackers"):
            registered.update(trackers)
        return registered

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

    def save_state(self, output_dir: Any = None, allow_nonfinite: bool = False) -> Path:
        """Everything needed to resume, into ``output_dir`` (None: the project's next automatic
        name, older ones pruned once it is whole). Weights holding NaN/inf are refused unless
        ``allow_nonfinite``: nothing written, nothing pruned."""
        if not allow_nonfinite:
            # every rank first (the check agrees across ranks, a collective: a save on the main
            # process only must be named as that mistake, not crash in a mismatched all-reduce)
            every_rank_must_arrive("save_state")
            self.checkpointer.refuse_nonfinite_weights()
        if output_dir is None:
            return automatic_checkpoint.save_automatically(
                self.project, self.checkpointer.save, self.plan.facts.is_main_process, wait_for_everyone
            )
        return self.checkpointer.save(output_dir)

    def load_state(self, input_dir: Any = None, allow_precision_change: bool = False) -> None:
        """What ``save_state`` wrote, into the prepared objects (None: the newest whole automatic checkpoint)."""
        if input_dir is None:
            input_dir = automatic_checkpoint.latest_directory(self.project)
        self.checkpointer.load(input_dir, allow_precision_change=allow_precision_change)

    def save_object(self, obj: Any, path: Any, safe: bool) -> None:
        """``obj`` written by the main process, atomically (as safetensors when ``safe``)."""
        if not self.plan.facts.is_main_process:
            return
        if safe:
            from safetensors.torch import save_file

            save_file(obj, str(path), metadata={"format": "pt"})
        else:
            write_file_atomically(obj, Path(path))

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full, plain state dict the unconverted model loads, on the CPU: gathered into the
        main process under a strategy that shards (the others get ``{}``), whole on every process otherwise."""
        inner = unwrap(model)
        state = self.plugins.full_state_dict(model)
        if state is None:
            state = inner.state_dict()
        exported = self.plugins.export_state_dict(inner, state)
        state = exported if exported is not None else state
        return model_files.detached_copy(model_files.tied_as_in(inner, state), inner)

    def save_model(
        self, model: torch.nn.Module, directory: Any, max_shard_size: int | str, safe: bool, allow_nonfinite: bool
    ) -> Path:
        """The unconverted model's weights as files (``model_files.write_model_files``), written by
        the main process; every process takes part in gathering them. Returns the file written."""
        inner = unwrap(model)
        model_files.refuse_weights_not_in_memory(inner)
        if not allow_nonfinite:
            refuse_nonfinite_weights([inner], "save_model", self.plan.facts.num_processes)
        state = self.full_state_dict(model)
        path = Path(directory) / (model_files.SAFE_WEIGHTS if safe else model_files.TORCH_WEIGHTS)
        if self.plan.facts.is_main_process:
            path = model_files.write_model_files(state, Path(directory), max_shard_size, safe)
        wait_for_everyone()
        return path

    # ------------------------------------------------------------------ the training loop's verbs

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided for gradient accumulation and scaled for fp16. A strategy that
        owns backward (DeepSpeed's engine) gets the undivided loss: it divides by its own steps."""
        self.preemption.at_iteration_start()  # a loop that feeds its own batches ends its iteration here
        model = self.prepared.models[0] if self.prepared.models else None
        plan = self.plan
        if model is None and plan.backend is not None:
            raise ConfigError(
                "backward() on an fp8 Accelerator, but no model was prepared, so nothing ran in FP8. "
                "Pass the model through accelerator.prepare(model, optimizer, ...) before training."
            )
        if self._strategy_backward is not None and self._strategy_backward(
            context=self.plugins.context, loss=loss, model=model, options=kwargs
        ):
            return
        # Read at the optimizer step (one host sync per step, none here): on_nonfinite_loss decides.
        self.step_state.observe_finite(loss)
        steps = plan.config.gradient_accumulation_steps
        plan.precision.backward(loss / steps if steps > 1 else loss, **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-batch: gradients sync and optimizers step every N-th call, and on the last batch
        of a prepared dataloader (so an epoch never ends with gradients left over)."""
        self.counters.step += 1
        loader = active_loader()
        at_end = self.sync_with_dataloader and bool(getattr(loader, "end_of_dataloader", False))
        sync = self.step_state.gradient_sync
        sync.sync_gradients = self.counters.step % self.plan.config.gradient_accumulation_steps == 0 or at_end
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
        factories = [self.plan.precision.autocast_factory(settings), self.plugins.backend_context_factory(None)]
        with contextlib.ExitStack() as stack:
            for factory in factories:
                if factory is not None:
                    stack.enter_context(factory())
            yield

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch steps the optimizers (its gradients are whole)."""
        return self.step_state.gradient_sync.sync_gradients

    def unscale_gradients(self, optimizers: Any = None) -> None:
        """fp16: bring the scaled gradients of ``optimizers`` (one, or a list; a prepared optimizer or
        the one inside it; None: every prepared one) back to their true size, once per optimizer
        step, and only on the micro-batch that steps: unscaled earlier, they would be summed with the
        scaled gradients of the micro-batches after (GradScaler's own rule: once per step)."""
        if self.plan.precision.scaler is not None and not self.sync_gradients:
            raise ConfigError(
                "fp16: gradients unscaled (unscale_gradients, clip_grad_norm_ or clip_grad_value_) on a micro-batch "
                "that does not step (gradient accumulation, "
                f"{self.plan.config.gradient_accumulation_steps} micro-batches a step): the micro-batches still to "
                "come would add scaled gradients to unscaled ones. Clip on the step's last micro-batch: `if "
                "accelerator.sync_gradients: accelerator.clip_grad_norm_(...)`, as in Accelerate's examples."
            )
        if optimizers is None:
            optimizers = self.prepared.optimizers
        for optimizer in optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]:
            self.plan.precision.unscale_gradients(getattr(optimizer, "optimizer", optimizer))

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by total norm, unscaling fp16 gradients first. The total norm comes free
        here: a NaN/inf gradient counts as a NaN/inf loss does (a strategy that owns precision,
        DeepSpeed, handles its own overflows)."""
        self.unscale_gradients(self.prepared.optimizers)
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        norm = self.plugins.clip_grad_norm(parameters, max_norm, norm_type)
        norm = norm if norm is not None else torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if torch.is_tensor(norm) and not self.plan.strategy_owns_precision:
            # FSDP2 returns the norm as a (replicated) DTensor: its plain value is what the step checks.
            plain = norm.full_tensor() if callable(getattr(norm, "full_tensor", None)) else norm
            self.step_state.observe_finite(plain, clipped=parameters)
        return norm

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp each gradient to ``[-clip_value, clip_value]``, unscaling fp16 gradients first."""
        if self.plan.strategy_owns_precision:
            raise UnsupportedCombinationError(
                f"clip_grad_value_ under the {self.context.strategy!r} strategy: it owns the gradients (and their "
                "loss scale), so they cannot be clamped from outside it. Use clip_grad_norm_ (the strategy's own "
                "gradient clipping), as Accelerate requires too."
            )
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @property
    def lomo_optimizers(self) -> list[Any]:
        """The prepared LOMO / AdaLomo optimizers (lomo-optim's), which update each parameter inside backward."""
        return [
            opt.optimizer
            for opt in self.prepared.optimizers
            if type(opt.optimizer).__name__ in LOMO_OPTIMIZERS and hasattr(opt.optimizer, "fused_backward")
        ]

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backward and update in one pass, by every prepared LOMO / AdaLomo optimizer."""
        lomo = self.lomo_optimizers
        if not lomo:
            raise ConfigError(
                "lomo_backward() needs a prepared LOMO or AdaLomo optimizer (lomo-optim's); none was prepared. "
                "Use accelerator.backward(loss) with other optimizers."
            )
        for optimizer in lomo:
            optimizer.fused_backward(loss, learning_rate)

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """A new accumulation count (transformers' Trainer sets it after the Accelerator is made): a
        new plan, and the hooks' context from now on, not a change to either."""
        self.plan = self.plan.with_accumulation_steps(int(steps))
        self.plugins.context = replace(self.plugins.context, gradient_accumulation_steps=int(steps))

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Batches that do not divide over the processes: with even batches off (``even_batches``,
        else the loaders' setting), ranks that run out of batches shadow the others' collectives
        instead of hanging. ``even_batches`` given applies to the prepared loaders of map-style
        datasets inside the block. On one process, nothing."""
        if self.plan.facts.num_processes == 1:
            yield
            return
        joining = not (self.preparation.settings.loaders.even_batches if even_batches is None else even_batches)
        if joining and self.plan.config.gradient_accumulation_steps > 1:
            raise UnsupportedCombinationError(
                "join_uneven_inputs(even_batches=False) with gradient accumulation: a rank that runs out of batches "
                "cannot tell which of the others' micro-batches reduce gradients, so their collectives would not "
                "match (a hang). Keep even_batches=True (the last round is filled up), or accumulate 1 step."
            )
        changed = []
        if even_batches is not None:
            for loader in self.prepared.dataloaders:
                if loader.dispatching or isinstance(loader.dataset, torch.utils.data.IterableDataset):
                    note("join_uneven_inputs(even_batches=...) changes map-style loaders only; a stream keeps its own.")
                    continue
                changed.append((loader, loader.even_batches))
                loader.even_batches = even_batches
        try:
            with self._join(list(joinables), joining):
                yield
        finally:
            for loader, before in changed:
                loader.even_batches = before

    @contextlib.contextmanager
    def _join(self, joinables: list[Any], joining: bool) -> Iterator[None]:
        """``join_uneven_inputs``' block: torch's ``Join`` over the user's DDP models and lowbit's
        optimizer step (a rank out of batches shadows the step's collectives). Inside it, a
        preemption save runs at the step that agreed it, on every rank alike: a joined rank has
        no next iteration at which the others' saves could find it."""
        from torch.distributed.algorithms.join import Join

        from lowbit.runtime.training.joining import OptimizerStepShadow

        def shadow_step() -> None:  # one step's collectives, in the order a step runs them
            self.step_state.shadow_finite_agreement()
            self.preemption.after_step()

        shadows = (
            [OptimizerStepShadow(shadow_step, self.plan.facts.device, joinables)] if self.prepared.optimizers else []
        )
        self.preemption.at_the_step = joining
        try:
            with Join([*joinables, *shadows], enable=joining, throw_on_early_termination=False):
                yield
        finally:
            self.preemption.at_the_step = False

    def forget_prepared(self) -> None:
        """``free_memory()``: every prepared object dropped, and what the run kept of them (the
        micro-batch count starts again)."""
        self.prepared.clear()
        self.norm_stats.forget()
        self.counters.step = 0

    def set_even_batches(self, even: bool) -> None:
        """Loaders prepared from now on fill up (or leave short) the last round of batches."""
        self.preparation.settings.loaders.even_batches = even

    def explain_backend_choice(self) -> str:
        """Why this backend: every installed backend with its priority and reason to decline."""
        if self.plan.backend is None:
            unused = Selection(
                "backend",
                None,
                None,
                "ranking",
                self.plan.registry.ranked("backend"),
                self.plan.hardware,
                list(self.plugin_manager.broken),
            )
            return (
                f"mixed_precision={self.plan.mixed_precision!r}: torch's own autocast and loss scaling; no "
                f"low-precision backend in use (they train mixed_precision='fp8' or 'fp4').\n{unused.explain()}"
            )
        return self.plan.backend.explain()

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
        if self.plan.strategy_owns_precision or any(callable(getattr(p, "to_local", None)) for p in model.parameters()):
            return f"not replayed under {self.context.strategy} (its weights are sharded, or its engine runs the model)"
        return find_nonfinite_origin(model, batch)

    # ------------------------------------------------------------------ what FP8 took, and what it would pay

    def _low_precision_model(self, model: torch.nn.Module | None, asked: str) -> torch.nn.Module:
        """``model`` (default: the first prepared one) without its wrappers, for a question only a
        low-precision backend's model answers."""
        if self.plan.backend is None or not (model is not None or self.prepared.models):
            raise ConfigError(
                f"{asked} needs a model prepared with a low-precision backend (mixed_precision='fp8' or 'fp4'); "
                f"this run uses {self.plan.mixed_precision!r}"
                f"{'' if self.prepared.models else ' and has prepared no model'}."
            )
        return unwrap(model if model is not None else self.prepared.models[0])

    def fp8_report(self, model: torch.nn.Module | None = None) -> str | None:
        """What FP8 took in a prepared model (the first one by default); None without FP8."""
        if self.plan.backend is None or not (model is not None or self.prepared.models):
            return None
        record = self.prepared.conversion_reports.get(unwrap(model if model is not None else self.prepared.models[0]))
        return conversion_report(record, self.backend_name, self.plan.mixed_precision, self.context.recipe_runs)

    def fp8_payoff(
        self,
        model: torch.nn.Module | None,
        tokens: int,
        seq_len: int | None,
        gpu: str | None,
        activation_checkpointing: str,
        shards: int,
    ) -> Any:
        """The predicted time of each Linear in bf16 and in this run's recipe, and of the step
        (:mod:`lowbit.runtime.observe.fp8_payoff`), for a prepared model."""
        from lowbit.runtime.observe import fp8_payoff

        raw = self._low_precision_model(model, "fp8_payoff()")
        record = self.prepared.conversion_reports.get(raw)
        cost = self.plan.backend.chosen.description.recipe_costs.get(record.recipe if record else "")
        if cost is None:
            raise ConfigError(
                f"The {self.backend_name!r} backend declares no cost for this run's recipe "
                f"({record.recipe if record else 'none reported'}), so there is nothing to predict with."
            )
        work = fp8_payoff.count_work(raw, max(tokens // (seq_len or tokens), 1), seq_len or tokens)
        return fp8_payoff.predict(
            work,
            fp8_payoff.known_gpu(gpu or self.plan.hardware.device_name),
            record.recipe,
            cost,
            record.kept_high_precision(),
            compiled=self.context.compiled,
            recompute=activation_checkpointing,
            shards=shards,
        )

    def enable_fp8_telemetry(self, model: torch.nn.Module | None, recorder: TelemetryRecorder) -> None:
        """Have the backend record FP8 numerics of ``model`` (default: the first prepared one) into
        ``recorder`` after each optimizer step, replacing any recorder before."""
        if self.plan.backend is None:
            raise ConfigError(
                f"FP8 telemetry needs a low-precision backend (mixed_precision='fp8' or 'fp4'); "
                f"this Accelerator uses {self.plan.mixed_precision!r}."
            )
        if model is None and not self.prepared.models:
            raise ConfigError("Prepare a model before enabling FP8 telemetry, or pass it: enable_fp8_telemetry(model).")
        if not self.plugins.enable_fp8_telemetry(self._low_precision_model(model, "FP8 telemetry"), recorder):
            raise UnsupportedCombinationError(f"FP8 telemetry is not supported by the {self.backend_name!r} backend.")
        self.stop_telemetry()
        self.telemetry = recorder
        self.step_state.step_observers.append(recorder.next_step)

    def fp8_stats(self) -> FP8StatsTable:
        """The latest sampled FP8 numerics, one row per layer and tensor."""
        if self.telemetry is None:
            raise ConfigError("Call accelerator.enable_fp8_telemetry() first (it is off by default).")
        self.telemetry.read_pending()
        return FP8StatsTable(sorted(self.telemetry.layers.values(), key=lambda s: s.layer))

    def stop_telemetry(self) -> None:
        if self.telemetry is not None:
            self.telemetry.remove()
            self.step_state.step_observers.remove(self.telemetry.next_step)
            self.telemetry = None


LOMO_OPTIMIZERS = ("Lomo", "AdaLomo")  # lomo-optim's, which update parameters inside backward


def _called_weakly(method: Callable[[], Any]) -> Callable[[], Any]:
    """``method()`` through a weak reference to its object (None once the object is gone)."""
    weak = weakref.WeakMethod(method)

    def call() -> Any:
        bound = weak()
        return None if bound is None else bound()

    return call
