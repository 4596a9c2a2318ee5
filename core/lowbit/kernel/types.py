"""The plain data that hooks exchange. Importing this module never imports torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
# mixed_precision values torch's autocast serves (lowbit.runtime.precision.Precision, no plugin);
# every other name ("fp8", "fp4", ...) is served by a low-precision backend that declares it.
NATIVE_PRECISIONS = frozenset({"no", "fp16", "bf16"})

# FP8 tensor-core GEMMs exist from Ada (sm_89) on; MXFP8 and NVFP4 from Blackwell (sm_100) on.
FP8_MIN_CAPABILITY = (8, 9)
MXFP8_MIN_CAPABILITY = (10, 0)
# What each compute capability is called, for messages that say which GPU is needed.
GPU_GENERATIONS = {(8, 9): "Ada, Hopper, Blackwell", (9, 0): "Hopper, Blackwell", (10, 0): "Blackwell"}


@dataclass(frozen=True)
class HardwareInfo:
    """What `detect_hardware` found. One device type per process: the one training runs on."""

    device_type: str  # "cpu" or "cuda" (or whatever a third-party detector reports)
    device_name: str
    device_count: int = 1
    compute_capability: tuple[int, int] | None = None
    cuda_version: tuple[int, int] | None = None  # the CUDA torch was built with, on a CUDA device

    @property
    def has_fp8_gemm(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= FP8_MIN_CAPABILITY

    def fp8_gemm_problem(self) -> str:
        """Why this hardware has no FP8 GEMMs, as backends phrase it; '' when it has them."""
        need = f"compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}"
        if self.compute_capability is None:
            return f"needs CUDA (a GPU with {need}); found {self.describe()}"
        if not self.has_fp8_gemm:
            return f"needs {need} (Ada, Hopper, Blackwell); found {self.describe()}"
        return ""

    def describe(self) -> str:
        """Short human label, e.g. 'CPU' or 'NVIDIA H100 (sm_90)'."""
        if self.compute_capability:
            major, minor = self.compute_capability
            return f"{self.device_name} (sm_{major}{minor})"
        return "CPU" if self.device_type == "cpu" else self.device_name


@dataclass(frozen=True)
class RecipeInfo:
    """One name of the recipe vocabulary: a number format and how it is scaled.

    ``precision`` is the ``mixed_precision`` it trains in ("fp8", "fp4"); ``block`` the elements
    that share one scale along a GEMM's inner dimension (32 for MXFP8, 16 for NVFP4; None for
    per-tensor or per-row scales); ``min_capability`` / ``min_cuda`` what a GPU needs to run its
    GEMMs natively. lowbit's own names live in :mod:`lowbit.kernel.recipe_names`; a plugin may
    declare more in its :class:`BackendDescription`.
    """

    name: str
    precision: str
    summary: str
    block: int | None = None
    min_capability: tuple[int, int] = FP8_MIN_CAPABILITY
    min_cuda: tuple[int, int] | None = None

    def hardware_problem(self, hardware: "HardwareInfo") -> str:
        """Why ``hardware`` cannot run this recipe's GEMMs natively, naming what it needs; '' when it can."""
        major, minor = self.min_capability
        need = f"a GPU with compute capability >= {major}.{minor}"
        generations = GPU_GENERATIONS.get(self.min_capability)
        need += f" ({generations})" if generations else ""
        if self.min_cuda:
            need += f" and CUDA >= {self.min_cuda[0]}.{self.min_cuda[1]}"
        found = hardware.describe()
        if hardware.compute_capability is None or hardware.compute_capability < self.min_capability:
            return f"{self.name} needs {need}; found {found}"
        if self.min_cuda and (hardware.cuda_version or (0, 0)) < self.min_cuda:
            cuda = ".".join(map(str, hardware.cuda_version)) if hardware.cuda_version else "none"
            return f"{self.name} needs {need}; found {found} with CUDA {cuda}"
        return ""


BF16_BYTES = 2


@dataclass(frozen=True)
class RecipeCost:
    """What a recipe costs a Linear beyond bf16 (lowbit.runtime.observe.fp8_payoff predicts with it).

    ``format``: the peak its low-precision GEMMs run at ("fp8", "fp4"); ``low_precision``: which of
    the (output, grad-input, grad-weight) GEMMs run in it; ``gemm_share``: their speed against a
    per-tensor-scaled FP8 GEMM of the same shape; ``cast_bytes``: per role ("input", "weight",
    "grad_output"), the bytes per element each of its cast kernels reads plus writes (bf16 in);
    ``fusable_read``: under torch.compile the first cast kernel of the input and of the output
    gradient reads what the op before it just wrote, which saves its bf16 read; ``value_bytes`` and
    ``block``: bytes per value the GEMM reads, plus one scale byte per ``block`` values (MX, NVFP4);
    ``source``: where the accounting comes from."""

    format: str
    cast_bytes: dict[str, tuple[float, ...]]
    source: str
    low_precision: tuple[bool, bool, bool] = (True, True, True)
    gemm_share: float = 1.0
    value_bytes: float = 1.0
    block: int | None = None
    fusable_read: bool = True


@dataclass
class PluginDescription:
    """What every plugin says about itself (the ``describe_backend`` hook); each role's record
    below adds what only that role has. The record's class is the plugin's role.

    `reason` explains why the plugin is unavailable; when `available` is True it is empty, or a
    note users should see (lowbit-style "emulated: no FP8 GEMMs here").
    `options_class` is the options dataclass users configure it with (None when it has none).
    `aliases` are other accepted spellings of `name` ("TE", "transformer_engine", ...).
    `libraries`: the distributions of the library it drives ("torchao"), whose versions
    `lowbit env` prints.
    """

    ROLE: ClassVar[str] = ""
    LABEL: ClassVar[str] = "plugin"  # how messages name the role
    name: str
    priority: int
    available: bool
    reason: str = ""
    options_class: type | None = None
    aliases: tuple[str, ...] = ()
    libraries: tuple[str, ...] = ()
    # Filled in by the plugin manager, not by the plugin:
    distribution: str = ""
    version: str = ""


@dataclass
class BackendDescription(PluginDescription):
    """A low-precision training backend: it converts models to train in the ``mixed_precision``
    names it serves ("fp8", "fp4", ...), with the recipes it offers."""

    ROLE: ClassVar[str] = "backend"
    LABEL: ClassVar[str] = "low-precision backend"
    # The mixed_precision names it trains in.
    precisions: tuple[str, ...] = ("fp8",)
    # The recipes it offers, best first per precision: names of lowbit's vocabulary
    # (lowbit.kernel.recipe_names) or RecipeInfo objects of its own. The first one of a precision
    # is its default there. Empty: one fixed recipe, nothing for the user to choose.
    recipes: tuple["str | RecipeInfo", ...] = ()
    # The recipes it runs emulated on hardware without their GEMMs (slowly, same numerics).
    emulates: tuple[str, ...] = ()
    # The recipes it emulates everywhere, even on hardware that has their GEMMs (it binds no native
    # kernel for them yet), so the ranking prefers a backend that runs them natively.
    emulated_only: tuple[str, ...] = ()
    # The torch dtype it keeps weights in when lower than the model's own (MS-AMP: "float8_e4m3fn");
    # empty when weights keep their values, as they should. The conformance kit then allows that
    # format's rounding instead of requiring bit equality.
    weight_storage: str = ""
    # Its bytes per parameter where they differ from fp32 master weights, fp32 gradients and fp32
    # AdamW states ("weights", "gradients", "optimizer"), "optimizer_low_bit" for low-bit
    # optimizer states it offers, and "frozen_linear" for the weight of a frozen base (LoRA's) it
    # stores its own way; read by `lowbit estimate-memory`.
    memory_per_parameter: dict[str, float] = field(default_factory=dict)
    # The strategies it cannot run under with what is installed here, by strategy name, and why
    # (MS-AMP under "deepspeed"); the ranking passes over it under those, naming it is an error.
    unusable_under: dict[str, str] = field(default_factory=dict)
    # What each recipe it runs natively costs a Linear beyond bf16, by recipe name; read by
    # `lowbit fp8-payoff`, the FP8 report's prediction and layer_filter="auto".
    recipe_costs: dict[str, "RecipeCost"] = field(default_factory=dict)


@dataclass(frozen=True)
class StrategyMemory:
    """How a strategy spreads one process's training memory, for ``lowbit estimate-memory``:
    which of weights, gradients and optimizer states it divides by the ranks, and the buffers it
    adds ("buckets": a second copy of the gradients, as DDP's gradient buckets; "block": one
    block's parameters unsharded while it computes; "gradients": unsharded gradients waiting for
    their reduce-scatter). ``note`` says what was measured."""

    shards_weights: bool = False
    shards_gradients: bool = False
    shards_optimizer: bool = False
    buffers: tuple[str, ...] = ()
    note: str = ""


@dataclass
class StrategyDescription(PluginDescription):
    """A distributed strategy: what it is, in place of its name, so the core never needs the name.

    ``distributed_types``: the ``distributed_type`` values (config file, ``LOWBIT_DISTRIBUTED_TYPE``,
    ``lowbit launch --distributed_type``) that choose it, besides its own name and aliases;
    Accelerate's names where it stands for one of them ("FSDP", "DEEPSPEED", "MULTI_GPU").
    ``reports_as``: the Accelerate ``DistributedType`` that ``accelerator.distributed_type``
    answers with (a data-parallel strategy: "MULTI_GPU", read as "MULTI_CPU" on a CPU).
    ``config_section``: its YAML section (and ``LOWBIT_<SECTION>`` JSON env var), e.g.
    "fsdp_config"; its content reaches the strategy as ``context.strategy_options``.
    ``kwargs_handler``: the class name of a ``kwargs_handlers`` object whose options it takes too
    (its ``to_strategy_options()``), e.g. "DistributedDataParallelKwargs".
    ``owns_precision``: it applies fp16/bf16 itself (DeepSpeed): lowbit adds no GradScaler.
    ``launch_flag``: a ``lowbit launch --<flag>`` switch that chooses it, e.g. "use_fsdp".
    ``checkpoint``: "lowbit" when ``save_state`` writes model and optimizer files itself, "own"
    when the strategy's ``save_checkpoint`` hook writes them (shown by ``lowbit plugins``).
    ``memory``: how it spreads memory, by the name ``lowbit estimate-memory`` shows (its own name,
    or one per variant: "zero1", "zero2", "zero3"); empty: estimate-memory does not offer it.
    ``checkpoint_reshards``: its own checkpoint loads on another number of processes (DCP's
    resharding); a lowbit-written checkpoint (whole files) always does.
    ``mesh_dims``: the dimensions of Accelerate's ``ParallelismConfig`` it lays a model out on
    ("dp_replicate", "dp_shard", "tp", "cp"), reading ``context.device_mesh``; a size above 1 in
    any other dimension is refused before ``prepare``, naming a strategy that has it.
    ``places_model``: it moves the model to the device itself, a block at a time (FSDP2's
    ``fully_shard``), so ``prepare()`` does not first put the whole unsharded model there: a model
    that fits only sharded never sits whole on one device.
    """

    ROLE: ClassVar[str] = "strategy"
    LABEL: ClassVar[str] = "distributed strategy"
    distributed_types: tuple[str, ...] = ()
    reports_as: str = "MULTI_GPU"
    config_section: str = ""
    kwargs_handler: str = ""
    owns_precision: bool = False
    launch_flag: str = ""
    checkpoint: str = "lowbit"
    memory: dict[str, StrategyMemory] = field(default_factory=dict)
    checkpoint_reshards: bool = False
    mesh_dims: tuple[str, ...] = ()
    places_model: bool = False


# The roles a plugin takes, by the name lowbit gives each (``lowbit plugins``, errors).
ROLES: dict[str, type[PluginDescription]] = {
    record.ROLE: record for record in (BackendDescription, StrategyDescription)
}


@dataclass
class ConversionReport:
    """What a low-precision backend's ``convert_model`` took in a model: the layers that now train in
    its format, and why each other candidate layer stays in high precision. The backend returns it
    inside :class:`ConvertedModel`; ``Accelerator.fp8_report()``, ``lowbit test`` and the
    conformance kit read it."""

    converted: list[str]
    skipped: dict[str, str] = field(default_factory=dict)  # layer name -> why it stays in high precision
    # Every candidate layer -> its type name, when the backend takes more kinds than nn.Linear.
    layer_types: dict[str, str] = field(default_factory=dict)
    recipe: str | None = None  # the recipe as the report names it
    padding: str = ""  # how token counts are padded for the GEMMs, when they are
    # The converted layers whose weights a sharding strategy all-gathers in the low-precision
    # format (torchao's float8 all-gather under FSDP2); None when the backend does not gather any.
    gathered_low_precision: list[str] | None = None
    # Frozen layers (frozen bases, FP8-published layers) now stored and run in the low-precision
    # format with no weight-gradient GEMM, and the bytes their weights held before and hold now.
    frozen_low_precision: list[str] = field(default_factory=list)
    frozen_bytes: tuple[int, int] = (0, 0)
    # How the recipe runs, when converting found otherwise than the run planned (a native recipe
    # whose kernels turn out missing once the library is imported: "emulated"); None: as planned.
    # The core hands it to the hooks that follow, in their context (which the backend cannot write).
    recipe_runs: str | None = None
    # Filled by the core, not the backend: the predicted step speedup on a GPU lowbit has figures for,
    # and the role each Linear played (lowbit.kernel.layer_roles.LayerRoles, decided before conversion).
    predicted: str = ""
    layer_roles: Any = None

    def kept_high_precision(self) -> dict[str, str]:
        """Every Linear that stays in high precision, with why: the skipped ones and the adapters
        (never candidates, so the backend does not list them)."""
        from lowbit.kernel.layer_roles import LayerRole

        adapters = self.layer_roles.named(LayerRole.ADAPTER) if self.layer_roles is not None else []
        return {**{name: "adapter kept in high precision" for name in adapters}, **self.skipped}


@dataclass
class ConvertedModel:
    """``convert_model``'s answer with its report: the converted model (it may be the same object)."""

    model: Any
    report: ConversionReport


@dataclass(frozen=True)
class StrategyIntegration:
    """What a low-precision backend adds to the distributed strategy's own setup (the
    ``strategy_integration`` hook's answer): each field None (or empty) for "nothing to add"."""

    # A drop-in for ``deepspeed.initialize`` (MS-AMP's ``msamp.deepspeed.initialize``).
    initialize: "Callable[..., Any] | None" = None
    # Merged into the strategy's config (DeepSpeed: ``{"msamp": {"enabled": True, "opt_level": "O2"}}``).
    config: dict[str, Any] = field(default_factory=dict)
    # ``(module, style) -> ParallelStyle | None``: how tensor parallelism lays out one of the backend's
    # converted modules (``style``: the plan's name, "colwise", "rowwise", ...); None: the plain one.
    tensor_parallel_style: "Callable[[Any, str], Any] | None" = None
    # A drop-in for ``torch.utils.checkpoint.checkpoint`` (called ``(function, *args, use_reentrant=False,
    # **kwargs)``) that activation checkpointing recomputes blocks with (TE's ``te.distributed.checkpoint``).
    activation_checkpoint: "Callable[..., Any] | None" = None


@dataclass(frozen=True)
class PrepareContext:
    """Everything a routed hook may need to know about the run it is preparing.

    One context per Accelerator: lowbit keeps no process-global precision state. Frozen: a plugin
    keeps what it learns in its own ``plugin_state``; what ``prepare()`` learns (``batch_size``,
    ``strategy_integration``) comes in a new context, handed to the hooks that follow.
    """

    hardware: HardwareInfo
    mixed_precision: str  # "no" | "fp16" | "bf16", or a low-precision backend's ("fp8", "fp4", ...)
    device: "torch.device"
    backend_options: Any = None  # the chosen low-precision backend's resolved options (its recipe kwargs)
    # How this hardware runs the chosen recipe: "native", or "emulated" (no GEMMs for it here).
    recipe_runs: str = "native"
    strategy: str = "none"  # "none", "ddp", "fsdp", "deepspeed", ... (the distributed backend's name)
    strategy_options: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    gradient_accumulation_steps: int = 1
    batch_size: int | None = None  # per-process micro-batch size, when a dataloader told us
    compiled: bool = False  # the model's forward is run through torch.compile (dynamo_backend)
    # The native autocast dtype of the forward (None: fp32), as the run's Precision says
    # (lowbit.runtime.precision): bf16 for bf16 and every low-precision backend's precision.
    autocast_dtype: "torch.dtype | None" = None
    # The run's DeviceMesh and the ParallelismConfig it was built from (None: no parallel layout
    # was asked for; the strategy spreads the model over every process its own way).
    device_mesh: Any = None
    parallelism: Any = None
    # What the chosen backend's strategy_integration hook returned, for the strategy to use.
    strategy_integration: StrategyIntegration = field(default_factory=StrategyIntegration)
    # The FP8 payoff prediction (``lowbit.runtime.observe.fp8_payoff.slower_layers``), given by the
    # runtime so a backend's ``layer_filter="auto"`` can leave out the layers FP8 would not speed up.
    predict_slower_layers: "Callable[..., dict[str, str]] | None" = None
    # Each plugin's own per-run state, by its type (see plugin_state); never shared between plugins.
    _plugin_states: dict[type, Any] = field(default_factory=dict, repr=False)

    def plugin_state(self, kind: "type[T]") -> "T":
        """The chosen plugin's own state for this run: an instance of ``kind`` (a class the plugin
        defines, e.g. a dataclass holding its recipe object), made with ``kind()`` on first use.
        One per Accelerator, so two Accelerators in a process never share it."""
        if kind not in self._plugin_states:
            self._plugin_states[kind] = kind()
        return self._plugin_states[kind]


def normalize_name(name: str) -> str:
    """Backend names compare this way: 'TE', 'Transformer-Engine' and 'transformer_engine' are equal,
    and so are Accelerate's 'MS-AMP' and 'MSAMP'."""
    return "".join(ch for ch in str(name).lower() if ch.isalnum())
