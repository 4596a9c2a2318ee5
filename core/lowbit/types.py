"""The plain data that hooks exchange. Importing this module never imports torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

BackendKind = Literal["fp8", "precision", "distributed"]

# FP8 tensor-core GEMMs exist from Ada (sm_89) on; MXFP8 from Blackwell (sm_100) on.
FP8_MIN_CAPABILITY = (8, 9)
MXFP8_MIN_CAPABILITY = (10, 0)


@dataclass(frozen=True)
class HardwareInfo:
    """What `detect_hardware` found. One device type per process: the one training runs on."""

    device_type: str  # "cpu" or "cuda" (or whatever a third-party detector reports)
    device_name: str
    device_count: int = 1
    compute_capability: tuple[int, int] | None = None

    @property
    def has_fp8_gemm(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= FP8_MIN_CAPABILITY

    @property
    def has_mxfp8_gemm(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= MXFP8_MIN_CAPABILITY

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


@dataclass
class BackendDescription:
    """What a plugin says about the backend it offers (the `describe_backend` hook).

    `reason` explains why the backend is unavailable; when `available` is True it is empty, or a
    note users should see (lowbit-style "emulated: no FP8 GEMMs here").
    `options_class` is the recipe-kwargs dataclass users configure it with (None when it has none).
    `aliases` are other accepted spellings of `name` ("TE", "transformer_engine", ...).
    `weight_storage` names the torch dtype the backend keeps weights in when it is lower than the
    model's own (MS-AMP: "float8_e4m3fn"); empty when weights keep their values, as they should.
    The conformance kit then allows that format's rounding instead of requiring bit equality.
    """

    name: str
    kind: BackendKind
    priority: int
    available: bool
    reason: str = ""
    options_class: type | None = None
    aliases: tuple[str, ...] = ()
    weight_storage: str = ""
    # Filled in by the plugin manager, not by the plugin:
    distribution: str = ""
    version: str = ""


@dataclass
class PrepareContext:
    """Everything a routed hook may need to know about the run it is preparing.

    One context per Accelerator: lowbit keeps no process-global precision state.
    """

    hardware: HardwareInfo
    mixed_precision: str  # "no" | "fp16" | "bf16" | "fp8"
    device: "torch.device"
    fp8_options: Any = None  # the chosen FP8 backend's resolved recipe kwargs
    strategy: str = "none"  # "none", "ddp", "fsdp", "deepspeed", ... (the distributed backend's name)
    strategy_options: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    gradient_accumulation_steps: int = 1
    batch_size: int | None = None  # per-process micro-batch size, when a dataloader told us
    compiled: bool = False  # the model's forward is run through torch.compile (dynamo_backend)
    # Scratch space for the chosen backends, per Accelerator (e.g. a recipe object built once).
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def autocast_dtype(self) -> "torch.dtype | None":
        """The native autocast dtype this precision uses. FP8 runs inside bf16 autocast."""
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(self.mixed_precision)


def normalize_name(name: str) -> str:
    """Backend names compare this way: 'TE', 'Transformer-Engine' and 'transformer_engine' are equal,
    and so are Accelerate's 'MS-AMP' and 'MSAMP'."""
    return "".join(ch for ch in str(name).lower() if ch.isalnum())
