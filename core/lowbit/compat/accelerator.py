"""Accelerate's ``Accelerator``, answered from one lowbit run.

``__init__`` turns Accelerate's arguments and handler objects (its own or Accelerate's, as
transformers' Trainer passes them) into a :class:`~lowbit.run.training_run.RunRequest` and builds
the :class:`~lowbit.run.training_run.TrainingRun`, which decides everything once: the settings,
the plugins, the ``Precision``, the layout. The methods are Accelerate's; ``prepare`` hands the
work to the run (the backend's conversion, then distribution, then the autocast contexts). After
``prepare()`` the step is plain torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from lowbit.kernel.errors import ConfigError
from lowbit.kernel.manager import LowbitPluginManager
from lowbit.kernel.recipes import RecipeKwargs
from lowbit.kernel.telemetry import FP8StatsTable, TelemetryRecorder
from lowbit.kernel.types import HardwareInfo

from lowbit.runtime.observe.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, Trackers
from lowbit.runtime.precision import Precision, SlowPrecisionNotice  # noqa: F401 - a warnings filter names it from here
from lowbit.runtime.process_group import RankFacts, wait_for_everyone
from lowbit.runtime.training import operations
from lowbit.runtime.training.data_loader import LoaderOptions, PreparedDataLoader
from lowbit.runtime.training.gradient_sync import force_gradient_sync, skip_gradient_sync
from lowbit.runtime.training.loader_shards import skip_first_batches
from lowbit.runtime.training.preparation import unwrap

from lowbit.run.layout import ParallelismConfig
from lowbit.run.settings import LowbitConfig
from lowbit.run.training_run import RunRequest, TrainingRun

from lowbit.compat.accelerate_names import reported_distributed_type
from lowbit.compat.accelerate_objects import from_accelerate
from lowbit.compat.handlers import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
    settings_from_plugin_objects,
    sort_handlers,
)
from lowbit.compat.state import AcceleratorState, DistributedType, GradientState, PartialState


class Accelerator(RankFacts):
    """Train a plain PyTorch loop in fp16, bf16 or fp8, on one process or many.

    Args mirror Hugging Face Accelerate: ``mixed_precision`` ("no", "fp16", "bf16", "fp8"),
    ``gradient_accumulation_steps``, ``cpu``, ``kwargs_handlers`` (also ``kwarg_handlers``),
    ``dynamo_backend``. lowbit adds ``fp8_fallback`` (precision to use, with a warning, when FP8
    cannot run here), ``on_nonfinite_loss`` (a NaN/inf loss or gradient: "skip" that optimizer step with a
    warning naming it, the default; "raise"; or "continue"), ``config_file`` and
    ``plugin_manager`` (tests, embedding).
    Arguments left as None come from env vars, then the config file, then defaults.
    """

    def __init__(
        self,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        kwargs_handlers: list[Any] | None = None,
        kwarg_handlers: list[Any] | None = None,
        dynamo_backend: str | None = None,
        fp8_fallback: str | None = None,
        on_nonfinite_loss: str | None = None,
        config_file: str | os.PathLike | None = None,
        plugin_manager: LowbitPluginManager | None = None,
        *,
        device_placement: bool = True,
        split_batches: bool | None = None,
        even_batches: bool | None = None,
        step_scheduler_with_optimizer: bool = True,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        parallelism_config: ParallelismConfig | None = None,
        rng_types: Any = None,
    ) -> None:
        # Accelerate's own handler and plugin objects (transformers' Trainer builds some) become lowbit's.
        recipe_handler, self.handlers = sort_handlers(_handler_list(kwargs_handlers, kwarg_handlers))
        accumulation, dataloader_config, project_config, layout = map(
            from_accelerate, (gradient_accumulation_plugin, dataloader_config, project_config, parallelism_config)
        )
        self.fsdp_plugin, self.deepspeed_plugin, self.dynamo_plugin = map(
            from_accelerate, (fsdp_plugin, deepspeed_plugin, dynamo_plugin)
        )
        given = dict(mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps)
        given.update(use_cpu=cpu, dynamo_backend=dynamo_backend, fp8_fallback=fp8_fallback)
        given.update(on_nonfinite_loss=on_nonfinite_loss)
        plugin_objects = (accumulation, self.fsdp_plugin, self.deepspeed_plugin, self.dynamo_plugin)
        given.update(settings_from_plugin_objects(*plugin_objects, given))
        self.gradient_accumulation_plugin = accumulation or GradientAccumulationPlugin()
        self.dataloader_config = dataloader_config or DataLoaderConfiguration(
            split_batches=bool(split_batches), even_batches=True if even_batches is None else even_batches
        )
        self.split_batches, self.device_placement = self.dataloader_config.split_batches, device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(str(project_dir))
        self.gradient_state = GradientState(self)
        self._run = TrainingRun(self._run_request(given, config_file, recipe_handler, layout), plugin_manager)
        self.state = AcceleratorState(self)
        self.flag_tensor: torch.Tensor | None = None
        self.log_with, self.rng_types = log_with, rng_types if rng_types is not None else ["generator"]
        trackers = {**self._run.plugins_trackers(), **LOGGER_TYPE_TO_CLASS} if log_with is not None else {}
        self._trackers = Trackers(log_with, trackers, self.logging_dir)

    def _run_request(
        self, settings: dict[str, Any], config_file: Any, recipe_handler: Any, layout: ParallelismConfig | None
    ) -> RunRequest:
        """This Accelerator's arguments and Accelerate's handler objects, as the run takes them."""
        group, scaler, autocast = (
            self.handlers.get(cls) for cls in (InitProcessGroupKwargs, GradScalerKwargs, AutocastKwargs)
        )
        loaders = self.dataloader_config
        return RunRequest(
            settings,
            config_file,
            recipe_handler,
            self.handlers,
            process_group_options=dataclasses.asdict(group) if group is not None else None,
            scaler_options=scaler.to_kwargs() if scaler is not None else {},
            autocast_options=autocast.to_kwargs() if autocast is not None else {},
            layout=layout,
            loaders=LoaderOptions(
                loaders.split_batches,
                loaders.even_batches,
                bool(loaders.non_blocking),
                loaders.dispatch_batches,
                bool(loaders.use_seedable_sampler),
                loaders.data_seed,
            ),
            device_placement=self.device_placement,
            step_scheduler_with_optimizer=self.step_scheduler_with_optimizer,
            compile_options=self.dynamo_plugin.options if self.dynamo_plugin is not None else None,
            sync=self.gradient_state.sync,
            sync_with_dataloader=self.gradient_accumulation_plugin.sync_with_dataloader,
            sync_each_batch=self.gradient_accumulation_plugin.sync_each_batch,
            gradient_state=self.gradient_state,
            project=self.project_configuration,
        )

    # ------------------------------------------------------------------ the run's decisions (lowbit.run.training_run)

    @property
    def run(self) -> TrainingRun:
        """The lowbit run this Accelerator hands every call to (:class:`~lowbit.run.training_run.TrainingRun`):
        its decisions and its parts, for tools built on lowbit (the conformance kit reads what a backend converted)."""
        return self._run

    @property
    def hardware(self) -> HardwareInfo:
        return self._run.plan.hardware

    @property
    def config(self) -> LowbitConfig:
        """The run's resolved settings (defaults < config file < ACCELERATE_* < LOWBIT_* env vars < arguments)."""
        return self._run.plan.config

    @property
    def mixed_precision(self) -> str:
        """The precision the run trains in: as asked, or the fp8_fallback taken."""
        return self._run.plan.mixed_precision

    @property
    def precision(self) -> Precision:
        return self._run.plan.precision

    # ------------------------------------------------------------------ process facts (one source: lowbit.compat.state)

    @property
    def num_processes(self) -> int:
        return self._run.plan.facts.num_processes

    @property
    def process_index(self) -> int:
        return self._run.plan.facts.process_index

    @property
    def local_process_index(self) -> int:
        return self._run.plan.facts.local_process_index

    @property
    def device(self) -> torch.device:
        return self._run.plan.facts.device

    # Accelerate's lists of what was prepared, which transformers' Trainer reads.
    @property
    def _models(self) -> list[torch.nn.Module]:
        return [*self._run.prepared.models, *self._run.prepared.evaluated]

    @property
    def _optimizers(self) -> list[Any]:
        return self._run.prepared.optimizers

    @property
    def _schedulers(self) -> list[Any]:
        return self._run.prepared.schedulers

    @property
    def _dataloaders(self) -> list[Any]:
        return self._run.prepared.dataloaders

    @property
    def step(self) -> int:
        """Micro-batches seen by ``accumulate()`` (saved and restored with the checkpoint)."""
        return self._run.counters.step

    @step.setter
    def step(self, value: int) -> None:
        self._run.counters.step = int(value)

    # ------------------------------------------------------------------ what was chosen

    @property
    def fp8_backend(self) -> str | None:
        """Name of the FP8 backend in use ("msamp", "te", "ao", ...), or None."""
        return self._run.backend_name

    @property
    def fp8_options(self) -> RecipeKwargs | None:
        """The chosen backend's resolved recipe (every field filled)."""
        return self._run.context.backend_options

    @property
    def distributed_strategy(self) -> str:
        return self._run.context.strategy

    def explain_backend_choice(self) -> str:
        """Why this backend: every installed backend with its priority and reason to decline."""
        return self._run.explain_backend_choice()

    # ------------------------------------------------------------------ processes

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (its local main process), as Accelerate's does."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        wait_for_everyone()

    @property
    def distributed_type(self) -> DistributedType | str:
        """Accelerate's name for how work is spread: what the chosen strategy reports itself as
        (an Accelerate ``DistributedType``, or the strategy's own name when it stands for none)."""
        reported = reported_distributed_type(self._run.strategy_reports_as, self.num_processes, self.device.type)
        return DistributedType(reported) if reported in DistributedType.__members__ else reported

    @property
    def is_fsdp2(self) -> bool:
        """Whether the model is sharded with FSDP (lowbit's FSDP is FSDP2's ``fully_shard``)."""
        return self.distributed_type == DistributedType.FSDP

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def multi_device(self) -> bool:
        """Several processes on accelerators with data parallelism (Accelerate's ``MULTI_*`` types
        but ``MULTI_CPU``)."""
        kind = self.distributed_type
        return (
            isinstance(kind, DistributedType)
            and kind.name.startswith("MULTI_")
            and kind is not DistributedType.MULTI_CPU
        )

    # ------------------------------------------------------------------ dataloader settings (DataLoaderConfiguration)

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        """Loaders prepared from now on fill up (or leave short) the last round of batches."""
        self.dataloader_config.even_batches = value
        self._run.set_even_batches(value)

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return False  # refused where it is given (DataLoaderConfiguration): resume with skip_first_batches

    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> ContextManager[None]:
        """Train or evaluate on batches that do not divide over the processes: with ``even_batches``
        off (here, or the Accelerator's), ranks that run out of batches shadow the others'
        collectives (``torch.distributed.algorithms.Join``) instead of hanging. ``even_batches``
        given here applies to the prepared loaders of map-style datasets inside the block. A DDP
        model joins; on one process this is a no-op."""
        return self._run.join_uneven_inputs(list(joinables), even_batches)

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets (``checkpoint_<n>``)."""
        return self.project_configuration.iteration

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes the model: every process of a parallel layout takes part in
        gathering it; otherwise the local main process."""
        return True if self.parallelism_config is not None else self.is_local_main_process

    @property
    def pipeline_parallel_rank(self) -> int:
        raise NotImplementedError(
            "Pipeline parallelism is not offered by lowbit (nor by Accelerate): ParallelismConfig lays a model out "
            "over dp_replicate, dp_shard, tp and cp."
        )

    # ------------------------------------------------------------------ Accelerate's attributes, read off the run

    @property
    def fp8_enabled(self) -> bool:
        return self.mixed_precision == "fp8"

    @property
    def native_amp(self) -> bool:
        """Whether the forward runs in torch's autocast (fp16, bf16, and the low-precision backends' bf16)."""
        return self._run.context.autocast_dtype is not None

    @property
    def has_fp8_handler(self) -> bool:
        return self.fp8_recipe_handler is not None

    def _recipe_handler_named(self, class_name: str) -> RecipeKwargs | None:
        handler = self.fp8_recipe_handler
        return handler if type(handler).__name__ == class_name else None

    ao_recipe_handler = property(lambda self: self._recipe_handler_named("AORecipeKwargs"))
    te_recipe_handler = property(lambda self: self._recipe_handler_named("TERecipeKwargs"))
    msamp_recipe_handler = property(lambda self: self._recipe_handler_named("MSAMPRecipeKwargs"))
    ddp_handler = property(lambda self: self.handlers.get(DistributedDataParallelKwargs))
    init_handler = property(lambda self: self.handlers.get(InitProcessGroupKwargs))
    scaler_handler = property(lambda self: self.handlers.get(GradScalerKwargs))
    autocast_handler = property(lambda self: self.handlers.get(AutocastKwargs))
    profile_handler = property(lambda self: self.handlers.get(ProfileKwargs))

    @property
    def delayed_fp8_autocast(self) -> bool:
        """False: Accelerate applies Transformer Engine's autocast outside the DDP/FSDP wrapper when
        asked (delayed); lowbit puts every backend's contexts on the module the strategy runs, once."""
        return False

    @property
    def deepspeed_engine_wrapped(self) -> Any:
        """Under DeepSpeed, the prepared engine (as ``.engine``); None otherwise."""
        if self.distributed_type != DistributedType.DEEPSPEED or not self._run.prepared.models:
            return None
        return types.SimpleNamespace(engine=self._run.prepared.models[0])

    @property
    def has_lomo_optimizer(self) -> bool:
        return bool(self._run.lomo_optimizers)

    # ------------------------------------------------------------------ parallel layout

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The run's ParallelismConfig (sizes settled against the job), or None."""
        return self._run.plan.layout

    @property
    def torch_device_mesh(self):
        """The run's DeviceMesh (dimensions named as in ParallelismConfig, with the flattened
        ``dp``, ``dp_shard_cp`` and ``dp_cp``), or None without a parallel layout."""
        return self._run.device_mesh

    @property
    def tensor_parallel_rank(self) -> int:
        return self._run.mesh_rank("tp")

    @property
    def context_parallel_rank(self) -> int:
        return self._run.mesh_rank("cp")

    @property
    def data_parallel_rank(self) -> int:
        return self._run.mesh_rank("dp_replicate")

    @property
    def data_parallel_shard_rank(self) -> int:
        return self._run.mesh_rank("dp_shard")

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> ContextManager[None]:
        """Split ``buffers`` (inputs, labels, position ids) along their sequence dimension over the
        context-parallel ranks for the block (torch's ``context_parallel``); does nothing, with a
        note, when cp_size is 1. Enter it anew for each step."""
        return self._run.context_parallel(buffers, buffer_seq_dims, no_restore_buffers)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self._run.set_gradient_accumulation_steps(steps)

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's loss scaler (Accelerate's ``accelerator.scaler``), None under other precisions."""
        return self.precision.scaler

    @property
    def fp8_recipe_handler(self) -> RecipeKwargs | None:
        return self.fp8_options

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 inf/nan gradients, a NaN/inf loss)."""
        return any(opt.step_was_skipped for opt in self._run.prepared.optimizers)

    @property
    def preemption_requested(self) -> bool:
        """True once the job got SIGTERM (a scheduler taking the machine): save and stop. On several
        processes, what the ranks agreed at the last poll (every LOWBIT_PREEMPTION_POLL_STEPS optimizer
        steps), so every rank reading it at the same point of its loop gets the same answer, and a read
        on one rank alone needs nothing of the others. The first read makes lowbit take over SIGTERM
        (see training/preemption.py)."""
        return self._run.preemption_requested()

    def on_preemption(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (e.g. ``lambda: accelerator.save_state("ckpt")``) on every rank after the
        first optimizer step that follows SIGTERM, once that iteration is whole (when the loop asks
        for its next batch, or the next backward starts), then exit with code 143."""
        self._run.on_preemption(callback)

    def main_process_first(self) -> ContextManager[None]:
        return PartialState().main_process_first()

    def local_main_process_first(self) -> ContextManager[None]:
        return PartialState().local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> ContextManager[Any]:
        return PartialState().split_between_processes(inputs, apply_padding=apply_padding)

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return PartialState().on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return PartialState().on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return PartialState().on_last_process(function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        return PartialState().on_process(function, process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        return PartialState().on_local_process(function, local_process_index)

    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors (or nests of them) from every process along dim 0."""
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather``, minus the samples repeated to even out the last batch across processes, so
        a metric over the gathered predictions counts every sample exactly once."""
        return operations.gather_for_metrics(input_data, use_gather_object, self.gradient_state.active_dataloader)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return operations.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        return operations.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        """Raise a flag on this process that ``check_trigger`` sees on every process (early stopping)."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called ``set_trigger`` since the last check (a collective: call it on all)."""
        flag = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self.device)
        if operations.reduce(flag, "sum").item() >= 1:
            self.flag_tensor = None
            return True
        return False

    # ------------------------------------------------------------------ experiment tracking

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers started on this process (none but on the main one)."""
        return self._trackers.started

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the trackers named in ``log_with`` (on the main process), storing ``config``."""
        if self.is_main_process:
            self._trackers.start(project_name, self.logging_dir, config, init_kwargs or {})

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        return self._trackers.get(name, unwrap)

    def log(
        self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict[str, Any]] | None = None
    ) -> None:
        """Log ``values`` to the trackers; the throughput of the last optimizer step goes with them
        (``throughput/...``, see ``accelerator.throughput``)."""
        self._trackers.log(values, step, log_kwargs or {}, self._run.throughput_figures())

    @property
    def throughput(self) -> dict[str, float]:
        """The last optimizer step's figures: ``throughput/tokens_per_s`` (all processes) and
        ``_per_device``, ``samples_per_s``, ``tflops_per_device``, ``mfu`` (against the device's
        dense bf16 peak; on a CPU its measured GEMM rate), ``fp8_gemm_share``, ``data_wait_share``,
        ``peak_memory_mb``, ``step_s`` (lowbit/runtime/observe/throughput.py); empty before the first step
        or with LOWBIT_THROUGHPUT=0."""
        return self._run.throughput_figures()

    def set_batch_tokens(self, tokens: int) -> None:
        """Tell the throughput meter how many tokens the current batch holds (when its shape does
        not say: packed sequences, padding to leave out)."""
        self._run.set_batch_tokens(tokens)

    def end_training(self) -> None:
        """Close the trackers and wait for every process."""
        self._trackers.finish()
        self.wait_for_everyone()

    # ------------------------------------------------------------------ prepare

    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers, in any order.

        Returns them in the order given (a single object is returned as itself).
        """
        return self._run.prepare(*objects)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """``prepare(model)`` alone, as Accelerate's method. ``evaluation_mode=True`` prepares a
        model only evaluated: put on the device (``device_placement=False``: left where it is, as
        transformers' Trainer asks for a model it laid out over the devices itself) and given the
        precision's forward, not distributed."""
        if evaluation_mode:
            return self._run.prepare_for_evaluation(model, place=device_placement is not False)
        if device_placement is False:
            raise ConfigError(
                "prepare_model(device_placement=False): lowbit always places a model prepared for "
                "training on its device (the strategy and the backend need it there); only "
                "evaluation_mode=True leaves a model where it is."
            )
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)

    def prepare_data_loader(
        self,
        data_loader: torch.utils.data.DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        prepared = self.prepare(data_loader)
        if slice_fn_for_dispatch is not None:
            prepared.slice_fn = slice_fn_for_dispatch
        return prepared

    # ------------------------------------------------------------------ training loop

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided for gradient accumulation and scaled for fp16 (a strategy that
        owns backward, DeepSpeed's engine, gets the undivided loss)."""
        self._run.backward(loss, **kwargs)

    def accumulate(self, *models: torch.nn.Module) -> ContextManager[None]:
        """Run one micro-batch; gradients sync and optimizers step every N-th call, and on the
        last batch of a prepared dataloader (so an epoch never ends with gradients left over)."""
        return self._run.accumulate(*models)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> ContextManager[None]:
        """The same contexts a prepared model's forward runs in, for code outside ``forward``;
        ``autocast_handler`` replaces the run's ``AutocastKwargs`` inside this block (as Accelerate's)."""
        return self._run.autocast(autocast_handler.to_kwargs() if autocast_handler is not None else None)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by total norm, unscaling fp16 gradients first."""
        return self._run.clip_grad_norm_(parameters, max_norm, norm_type)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Bring fp16-scaled gradients back to their true size (before reading or clipping them), for
        ``optimizer`` (one, or a list; a prepared optimizer or the one inside it) or every prepared
        optimizer; a no-op in every other precision. Once per step: the step does not unscale again."""
        self._run.unscale_gradients(optimizer)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp each gradient to ``[-clip_value, clip_value]``, unscaling fp16 gradients first."""
        self._run.clip_grad_value_(parameters, clip_value)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backward and update in one pass for LOMO / AdaLomo optimizers (``lomo-optim``), which
        update each parameter as its gradient is made; they must have been prepared."""
        self._run.lomo_backward(loss, learning_rate)

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` (or a part of it) was laid out over several devices by a ``device_map``
        (big-model inference); such a model is not trained data-parallel."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip the gradient all-reduce inside this block (DDP and FSDP2; a no-op on one process)."""
        with contextlib.ExitStack() as stack:
            skip_gradient_sync(model, stack)
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """Reduce the gradients in the next backward even after forwards run under ``no_sync``
        (several forwards, then backwards, the last of which syncs); a no-op on one process."""
        with contextlib.ExitStack() as stack:
            force_gradient_sync(model, stack)
            yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """``dl`` as it is: it adapts a loader to DeepSpeed's Ulysses sequence parallelism, which
        needs ``sp_size`` > 1, and lowbit refuses that setting when the Accelerator is made
        (transformers' Trainer calls this after preparing)."""
        return dl

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """The prepared ``dataloader``, starting ``num_batches`` batches into its epoch (to resume)."""
        return skip_first_batches(dataloader, num_batches)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """``torch.save`` on the main process only, written atomically."""
        self._run.save_object(obj, f, safe_serialization)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object (and return Nones for ``objects``), then collect garbage."""
        from lowbit.runtime.training.memory import release_memory

        self._run.forget_prepared()
        return release_memory(*objects)

    clear = free_memory

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The model without distributed wrappers (and without the autocast forward if asked);
        compiled when it was compiled itself and ``keep_torch_compile`` (Accelerate's default)."""
        return unwrap(model, keep_fp32_wrapper, keep_torch_compile)

    # ------------------------------------------------------------------ diagnostics

    def profile(self, output_dir: str | os.PathLike | ProfileKwargs | None = None, **options: Any) -> ContextManager:
        """Two forms. ``profile("runs/profile")``: lowbit's scheduled profile (1 wait, 1 warm-up, 3
        active steps, shapes and memory recorded; call ``.step()`` on what it yields once per
        step); each rank writes ``trace_rank{N}.json``, the main process also ``summary.txt``.
        ``profile()`` or ``profile(ProfileKwargs(...))``: Accelerate's, the whole block profiled with
        the ProfileKwargs given here or in ``kwargs_handlers``."""
        from lowbit.runtime.observe import profiling

        if output_dir is None and not options or isinstance(output_dir, ProfileKwargs):
            handler = output_dir or self.handlers.get(ProfileKwargs) or ProfileKwargs()
            return profiling.profile_as_accelerate(handler, self.process_index, self.device)
        return profiling.profile(
            output_dir or "runs/profile", self.process_index, self.is_main_process, self.device, **options
        )

    def fp8_report(self, model: torch.nn.Module | None = None) -> str | None:
        """What FP8 took in a prepared model (the first one by default): how many Linear layers
        train in FP8 and why the others stay in high precision. None without FP8."""
        return self._run.fp8_report(model)

    def fp8_payoff(
        self,
        model: torch.nn.Module | None = None,
        tokens: int = 8192,
        seq_len: int | None = None,
        gpu: str | None = None,
        activation_checkpointing: str = "none",
        shards: int = 1,
    ) -> Any:
        """``lowbit fp8-payoff`` for a prepared model (the first one by default): the predicted time
        of each Linear in bf16 and in this run's recipe, and of the step, at ``tokens`` per
        micro-batch on ``gpu`` (default: this device, when lowbit has its figures). Returns a
        :class:`~lowbit.runtime.observe.fp8_payoff.StepPrediction` (``.speedup``; ``table()`` prints it)."""
        return self._run.fp8_payoff(model, tokens, seq_len, gpu, activation_checkpointing, shards)

    def enable_fp8_telemetry(
        self,
        model: torch.nn.Module | None = None,
        every_n_steps: int = 1,
        saturation_warning: float = 0.001,
        underflow_warning: float = 0.01,
    ) -> None:
        """Collect per-layer FP8 numerics (amax, scale, saturated and flushed fractions) every
        ``every_n_steps`` optimizer steps; warn when a tensor's saturated fraction passes
        ``saturation_warning`` (0.1%) or its flushed-to-zero fraction passes ``underflow_warning`` (1%).
        Off by default: when off, nothing is observed and training speed is unchanged."""
        recorder = TelemetryRecorder(every_n_steps, saturation_warning, underflow_warning)
        self._run.enable_fp8_telemetry(model, recorder)

    def fp8_stats(self) -> FP8StatsTable:
        """The latest sampled FP8 numerics, one row per layer and tensor (prints as a table)."""
        return self._run.fp8_stats()

    def disable_fp8_telemetry(self) -> None:
        self._run.stop_telemetry()

    # ------------------------------------------------------------------ checkpoints

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Carry more objects (anything with ``state_dict``/``load_state_dict``) through
        ``save_state``/``load_state``; register them in the same order before loading."""
        self._run.register_for_checkpointing(*objects)

    def register_save_state_pre_hook(self, hook: Callable[[list, list, str], None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs at the start of every ``save_state``, on every
        process; taking a model's weights out of ``weights`` leaves that model to the hook (e.g.
        ``save_pretrained`` into ``output_dir``, beside lowbit's files). ``handle.remove()`` unregisters it."""
        return self._run.add_checkpoint_hook("save", hook)

    def register_load_state_pre_hook(self, hook: Callable[[list, str], None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs at the start of every ``load_state``, on every process;
        taking a model out of ``models`` leaves loading it to the hook."""
        return self._run.add_checkpoint_hook("load", hook)

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        *,
        allow_nonfinite: bool = False,
        **save_model_func_kwargs: Any,
    ) -> Path:
        """Save everything needed to resume: model, optimizer, scheduler, scaler, RNG, counters and
        registered objects. Files go beside any others in ``output_dir``; none of those is touched,
        and a crash at any point leaves the previous checkpoint (see ``lowbit.runtime.checkpoint.files``).
        With no ``output_dir``, ``ProjectConfiguration(automatic_checkpoint_naming=True)`` names it
        ``<project_dir>/checkpoints/checkpoint_<N>`` and keeps the newest ``total_limit``.
        ``safe_serialization`` is accepted as in Accelerate; lowbit's files are read back with
        ``torch.load(weights_only=True)`` either way, so both values write the same safe files.
        Weights holding NaN/inf are refused (nothing written, nothing pruned) unless ``allow_nonfinite``
        (lowbit's; Accelerate writes them)."""
        _refuse_function_options("save_state", save_model_func_kwargs, "use save_model(...) for those")
        return self._run.save_state(output_dir, allow_nonfinite)

    def load_state(
        self,
        input_dir: str | os.PathLike | None = None,
        *,
        allow_precision_change: bool = False,
        **load_model_func_kwargs: Any,
    ) -> None:
        """Restore what ``save_state`` wrote into the objects already prepared, after checking each
        file's checksum. With no ``input_dir``, the newest automatically named checkpoint.
        ``allow_precision_change=True`` (lowbit's) resumes a run saved in another precision or by
        another low-precision backend, e.g. an FP8/NVFP4 run finished in bf16: weights, optimizer,
        scheduler and counters load; the old backend's own state (scales, amax histories) is left out."""
        _refuse_function_options("load_state", load_model_func_kwargs)
        self._run.load_state(input_dir, allow_precision_change)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full, plain state dict an unconverted model loads, on the CPU. Call it on every
        process: under a strategy that shards (FSDP2, ZeRO-3) it is gathered into the main process
        only and the others get ``{}``, as in Accelerate; otherwise every process gets it."""
        return self._run.full_state_dict(model)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
        *,
        allow_nonfinite: bool = False,
    ) -> Path:
        """Write the model's weights as Accelerate does: ``model.safetensors`` (``pytorch_model.bin``
        with ``safe_serialization=False``), sharded with an index above ``max_shard_size``. The
        names and layout are the unconverted model's, whichever backend trained it. Returns the
        file written (the index when sharded). Weights holding NaN/inf are refused unless
        ``allow_nonfinite`` (lowbit's; Accelerate writes them)."""
        return self._run.save_model(model, save_directory, max_shard_size, safe_serialization, allow_nonfinite)


# ---------------------------------------------------------------------- helpers


def _handler_list(kwargs_handlers: Any, kwarg_handlers: Any) -> Any:
    """``kwargs_handlers`` (or Accelerate's other spelling), each object as lowbit's own."""
    if kwargs_handlers is not None and kwarg_handlers is not None:
        raise ConfigError("Give kwargs_handlers or kwarg_handlers (the spelling in Accelerate's docs), not both.")
    given = kwargs_handlers if kwargs_handlers is not None else kwarg_handlers or []
    return [from_accelerate(h) for h in given] if isinstance(given, (list, tuple)) else given


def _refuse_function_options(method: str, options: dict[str, Any], instead: str = "") -> None:
    """Accelerate's ``save_state``/``load_state`` pass extra options to a save or load function;
    lowbit's write and read their own files and take none: named rather than dropped."""
    if options:
        raise ConfigError(
            f"{method} got {', '.join(options)}: lowbit's {method} writes and reads its own files and takes no "
            f"save or load function options{'; ' + instead if instead else ''}."
        )
