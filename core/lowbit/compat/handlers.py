"""Accelerate's settings objects under their names: kwargs handlers, project and dataloader
configuration, and the plugin dataclasses scripts pass to ``Accelerator(...)``.

Each field here is one lowbit reads. A field it cannot honour is refused when set to a value
other than its default (``UnsupportedSetting``), never silently dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

from lowbit.kernel.errors import ConfigError
from lowbit.kernel.recipes import FP8RecipeKwargs, RecipeKwargs

from lowbit.run.accelerate_config import note_ignored, translate_fsdp


def refuse_unsupported(obj: Any, unsupported: dict[str, str]) -> None:
    """Raise for each field in ``unsupported`` that was set away from its default."""
    for field in dataclasses.fields(obj):
        if field.name in unsupported and getattr(obj, field.name) != field.default:
            raise ConfigError(
                f"{type(obj).__name__}({field.name}=...) is not supported by lowbit: {unsupported[field.name]}"
            )


class KwargsHandler:
    """Base of the kwargs handlers: ``to_kwargs()`` gives the fields changed from their defaults."""

    def to_kwargs(self) -> dict[str, Any]:
        defaults = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(defaults, f.name)
        }


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a run keeps its files: ``project_dir`` (trackers' logs, checkpoints) and automatic
    checkpoint naming (``checkpoints/checkpoint_N``, keeping at most ``total_limit``)."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


@dataclasses.dataclass
class DataLoaderConfiguration:
    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        refuse_unsupported(self, {"use_stateful_dataloader": "resume with accelerator.skip_first_batches instead."})


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class TorchDynamoPlugin:
    backend: str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None  # compile each repeated block, not the whole model

    def __post_init__(self) -> None:
        # Fields left unset come from Accelerate's launcher variables, as in Accelerate.
        for name, env in (
            ("backend", "BACKEND"),
            ("mode", "MODE"),
            ("fullgraph", "USE_FULLGRAPH"),
            ("dynamic", "USE_DYNAMIC"),
            ("use_regional_compilation", "USE_REGIONAL_COMPILATION"),
        ):
            value = os.environ.get("ACCELERATE_DYNAMO_" + env)
            if getattr(self, name) is None and value:
                setattr(
                    self, name, value if name in ("backend", "mode") else value.strip().lower() in ("1", "true", "yes")
                )

    def to_kwargs(self) -> dict[str, Any]:
        """``torch.compile``'s keyword arguments this plugin sets (the ones left unset are omitted)."""
        given = {
            "backend": str(getattr(self.backend, "value", self.backend)).lower() if self.backend is not None else None,
            "mode": self.mode,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "options": self.options,
        }
        return {k: v for k, v in given.items() if v is not None}


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """FSDP2 settings; the fields lowbit's FSDP strategy reads go to its ``fsdp_config``."""

    fsdp_version: int | None = None
    reshard_after_forward: Any = None
    auto_wrap_policy: Any = None
    transformer_cls_names_to_wrap: Any = None
    cpu_offload: Any = None
    # What save_model and get_state_dict give under lowbit's FSDP2: the full state dict (transformers'
    # Trainer reads it to choose how to save; "SHARDED_STATE_DICT" makes it write DCP folders).
    state_dict_type: Any = "FULL_STATE_DICT"
    activation_checkpointing: bool | None = None
    # Accelerate's other keywords: accepted, each read as its fsdp_config key is (most do nothing
    # under FSDP2 and are named in a note; sharding_strategy sets the reshard flag).
    sharding_strategy: Any = None
    backward_prefetch: Any = None
    forward_prefetch: Any = None
    use_orig_params: Any = None
    sync_module_states: Any = None
    cpu_ram_efficient_loading: Any = None
    min_num_params: Any = None
    mixed_precision_policy: Any = None
    ignored_modules: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: Any = None
    param_init_fn: Any = None
    fsdp_auto_wrap_policy: Any = None  # the spelling of Accelerate's torchao FSDP2 docs, for auto_wrap_policy

    def __post_init__(self) -> None:
        if self.fsdp_auto_wrap_policy is not None:
            if self.auto_wrap_policy not in (None, self.fsdp_auto_wrap_policy):
                raise ConfigError("Give auto_wrap_policy or fsdp_auto_wrap_policy (the same setting), not both.")
            self.auto_wrap_policy, self.fsdp_auto_wrap_policy = self.fsdp_auto_wrap_policy, None
        # set_mixed_precision's name ("bf16", "fp8", ...): the run's precision unless the Accelerator names one.
        self.mixed_precision: str | None = None

    def set_mixed_precision(self, mixed_precision: str, buffer_autocast: bool = False, override: bool = False) -> None:
        """The precision to train in, as Accelerate's FSDP2 examples set it ("no", "fp16", "bf16",
        "fp8"): the Accelerator trains in it when its own ``mixed_precision`` is not given.
        FSDP2's parameter and reduce dtypes then follow from it, as lowbit sets them for every precision."""
        if self.mixed_precision is None or override:
            self.mixed_precision = str(getattr(mixed_precision, "value", mixed_precision))

    def to_fsdp_config(self) -> dict[str, Any]:
        """Read the way an Accelerate fsdp_config section is, so that what lowbit cannot do
        (CPU offload, activation checkpointing) is an error here too, not silently dropped."""
        offload = self.cpu_offload
        if offload is not None and not isinstance(offload, (bool, str)):
            # FSDP1's CPUOffload(offload_params=...), or FSDP2's policies: OffloadPolicy() is "no offload",
            # its subclass CPUOffloadPolicy offloads.
            offload = getattr(offload, "offload_params", type(offload).__name__ != "OffloadPolicy")
        section = {
            "fsdp_reshard_after_forward": self.reshard_after_forward,
            "fsdp_sharding_strategy": getattr(self.sharding_strategy, "name", self.sharding_strategy),
            "fsdp_transformer_layer_cls_to_wrap": self.transformer_cls_names_to_wrap,
            "fsdp_offload_params": offload,
            "fsdp_activation_checkpointing": self.activation_checkpointing,
            "fsdp_auto_wrap_policy": self.auto_wrap_policy if isinstance(self.auto_wrap_policy, str) else None,
            "fsdp_backward_prefetch": self.backward_prefetch,
            "fsdp_forward_prefetch": self.forward_prefetch,
            "fsdp_use_orig_params": self.use_orig_params,
            "fsdp_sync_module_states": self.sync_module_states,
            "fsdp_cpu_ram_efficient_loading": self.cpu_ram_efficient_loading,
            "fsdp_min_num_params": self.min_num_params,
        }
        ignored = [
            f"FullyShardedDataParallelPlugin({name}=...) (FSDP2 here: lowbit sets it itself)"
            for name in (
                "mixed_precision_policy",
                "ignored_modules",
                "state_dict_config",
                "optim_state_dict_config",
                "limit_all_gathers",
                "param_init_fn",
            )
            if getattr(self, name) is not None
        ]
        config = translate_fsdp(
            {k: v for k, v in section.items() if v is not None}, "FullyShardedDataParallelPlugin", ignored
        )
        note_ignored("FullyShardedDataParallelPlugin", ignored)
        return config


@dataclasses.dataclass
class DeepSpeedPlugin:
    """DeepSpeed settings; lowbit-deepspeed builds its config from them (or from ``hf_ds_config``)."""

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    zero3_init_flag: bool | None = None

    def to_deepspeed_config(self) -> dict[str, Any]:
        # hf_ds_config: a path, a dict, or an object holding the dict as ``.config`` (transformers'
        # HfDeepSpeedConfig, which Trainer fills from its TrainingArguments).
        given = getattr(self.hf_ds_config, "config", self.hf_ds_config)
        values = {
            "deepspeed_config_file": given if isinstance(given, (str, os.PathLike)) else None,
            "config": given if isinstance(given, dict) else None,
            "zero_stage": self.zero_stage,
            "gradient_clipping": self.gradient_clipping,
            "offload_optimizer_device": self.offload_optimizer_device,
            "offload_param_device": self.offload_param_device,
        }
        return {k: v for k, v in values.items() if v is not None}


class DDPCommunicationHookType(str, enum.Enum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for ``torch.nn.parallel.DistributedDataParallel``, and a gradient comm hook."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    def to_strategy_options(self) -> dict[str, Any]:
        """DDP's constructor arguments, plus the comm hook settings (by value) for the DDP strategy."""
        kwargs = self.to_kwargs()
        for key in ("comm_hook", "comm_wrapper"):
            if key in kwargs:
                kwargs[key] = DDPCommunicationHookType(kwargs[key]).value
        return kwargs


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for the fp16 ``torch.amp.GradScaler``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group`` (the backend and timeout)."""

    backend: str | None = None
    init_method: str | None = None
    timeout: Any = None


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: bool | None = None


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """Settings for ``accelerator.profile()`` (torch.profiler's arguments)."""

    activities: list | None = None
    schedule_option: dict | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None


HANDLER_CLASSES = (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    AutocastKwargs,
    ProfileKwargs,
)


def sort_handlers(handlers: Any) -> tuple[Any, dict[type, Any]]:
    """``kwargs_handlers`` as the run takes them: the one recipe handler (or None), and the other
    handler objects by class."""
    if not isinstance(handlers, (list, tuple)):
        raise ConfigError(
            f"kwargs_handlers must be a list of handler objects, e.g. kwargs_handlers=[{type(handlers).__name__}()]; "
            f"got a single {type(handlers).__name__}."
        )
    recipe_handlers = [h for h in handlers if isinstance(h, (RecipeKwargs, FP8RecipeKwargs))]
    unknown = [h for h in handlers if h not in recipe_handlers and not isinstance(h, HANDLER_CLASSES)]
    if unknown:
        raise ConfigError(
            f"kwargs_handlers got {type(unknown[0]).__name__}, which lowbit does not use. It takes FP8RecipeKwargs, "
            "a backend's recipe class (AORecipeKwargs, TERecipeKwargs, ...), and "
            + ", ".join(c.__name__ for c in HANDLER_CLASSES)
            + "."
        )
    if len(recipe_handlers) > 1:
        names = ", ".join(type(h).__name__ for h in recipe_handlers)
        raise ConfigError(f"Give one FP8 recipe handler, got {len(recipe_handlers)}: {names}.")
    return (recipe_handlers[0] if recipe_handlers else None), {
        type(h): h for h in handlers if isinstance(h, HANDLER_CLASSES)
    }


def _micro_batches(value: Any, written: str) -> None:
    """A plugin object's accumulation count, refused as the user wrote it (not as lowbit's option)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{written.replace('...', repr(value))}: the micro-batches per optimizer step, a whole number of at "
            "least 1 (1: no accumulation)."
        )


def settings_from_plugin_objects(
    accumulation: Any, fsdp: Any, deepspeed: Any, dynamo: Any, explicit: dict[str, Any]
) -> dict[str, Any]:
    """Accelerate's plugin objects as lowbit settings (explicit arguments, so they win over files)."""
    out: dict[str, Any] = {}
    if accumulation is not None and accumulation.num_steps is not None:
        _micro_batches(accumulation.num_steps, "GradientAccumulationPlugin(num_steps=...)")
        if explicit.get("gradient_accumulation_steps") not in (None, accumulation.num_steps):
            raise ConfigError("Give gradient_accumulation_steps or gradient_accumulation_plugin.num_steps, not both.")
        out["gradient_accumulation_steps"] = accumulation.num_steps
    if fsdp is not None and deepspeed is not None:
        raise ConfigError("Give fsdp_plugin or deepspeed_plugin, not both: a model is sharded by one strategy.")
    if fsdp is not None:
        out.update(distributed_type="FSDP", fsdp_config=fsdp.to_fsdp_config())
        if fsdp.mixed_precision is not None and explicit.get("mixed_precision") is None:
            out["mixed_precision"] = fsdp.mixed_precision
    if deepspeed is not None:
        out.update(distributed_type="DEEPSPEED", deepspeed_config=deepspeed.to_deepspeed_config())
        if deepspeed.gradient_accumulation_steps is not None:
            _micro_batches(deepspeed.gradient_accumulation_steps, "DeepSpeedPlugin(gradient_accumulation_steps=...)")
            out["gradient_accumulation_steps"] = deepspeed.gradient_accumulation_steps
    if dynamo is not None and dynamo.backend is not None and not dynamo.disable:
        out["dynamo_backend"] = str(getattr(dynamo.backend, "value", dynamo.backend)).lower()
        out.update(
            dynamo_mode=dynamo.mode,
            dynamo_use_fullgraph=dynamo.fullgraph,
            dynamo_use_dynamic=dynamo.dynamic,
            dynamo_use_regional_compilation=dynamo.use_regional_compilation,
        )
    return out
