"""Accelerate's own names, mapped to what lowbit calls them: its fp8_backend values and distributed
types. One of the few core modules that name plugins, each because it speaks Accelerate's vocabulary
(``tests/test_open_core.py`` lists them all, with why).

Accelerate names its FP8 backends (``fp8_backend: TE | MSAMP | AO``, ``TERecipeKwargs``, ...) and
its distributed types (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``, ``DEEPSPEED``); a script or
config file written for Accelerate uses those names, and lowbit must say which distribution to
install when the plugin behind one is absent. Which plugin *is* chosen is never decided here:
plugins describe themselves (``describe_backend``), and the core asks them.
"""

from __future__ import annotations

import enum
from typing import Any

from lowbit.kernel.errors import NOT_OFFERED_MARK

from lowbit.compat.paths import public_path

# Accelerate's distributed type for "data parallel on this device type".
_DATA_PARALLEL_BY_DEVICE = {"cuda": "MULTI_GPU", "cpu": "MULTI_CPU"}


def reported_distributed_type(reports_as: str | None, num_processes: int, device_type: str) -> str:
    """Accelerate's name for how work is spread: the chosen strategy's ``reports_as`` (None: no
    strategy, so NO on one process and data parallel on several), as Accelerate reports it on this
    device: its MULTI_GPU is MULTI_CPU on a CPU."""
    if reports_as is None:
        reports_as = "NO" if num_processes == 1 else "MULTI_GPU"
    if reports_as in ("MULTI_GPU", "MULTI_CPU"):
        return _DATA_PARALLEL_BY_DEVICE.get(device_type, reports_as)
    return reports_as


class DistributedType(str, enum.Enum):
    """How the work is spread over processes; compares equal to its string value."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"


# Why big-model inference dispatch (accelerate.big_modeling, .hooks, .utils.modeling) is refused, and what to use.
INFERENCE_WHY = "places a model over devices and disk for inference, which lowbit does not do (it trains)"
INFERENCE_USE = "Accelerate's (`pip install accelerate`) or transformers' `from_pretrained(..., device_map='auto')`"


def not_offered(name: str, why: str, use: str, is_class: bool = False) -> Any:
    """A stand-in for an Accelerate name whose job lowbit does not do: it imports, and raises
    UnsupportedCombinationError when called or instantiated, saying what to use."""
    from lowbit.kernel.errors import UnsupportedCombinationError

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedCombinationError(f"{name} {why}. Use {use}.")

    short = name.rpartition(".")[2]
    doc = f"Not offered by lowbit: {name} {why}."
    if is_class:
        return type(short, (), {"__init__": refuse, "__doc__": doc, NOT_OFFERED_MARK: why})
    refuse.__name__ = refuse.__qualname__ = short
    refuse.__doc__ = doc
    setattr(refuse, NOT_OFFERED_MARK, why)
    return refuse


def refusing_module(module: str, why: Any) -> Any:
    """A module ``__getattr__`` (PEP 562) for an Accelerate module whose job lowbit does not do:
    every public name gives a stand-in that refuses when used. ``why``: (what it does, what to
    use), or a function of the name giving them."""
    accelerate_path = public_path(module).replace("lowbit", "accelerate", 1)

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        does, use = why(name) if callable(why) else why
        return not_offered(f"{accelerate_path}.{name}", does, use, is_class=name[:1].isupper())

    return __getattr__


def _vocabulary(name: str, members: str, doc: str) -> type[enum.Enum]:
    """A str enum of Accelerate's ("MEMBER=value MEMBER=value ...", a bare MEMBER is its own value)."""
    pairs = [m.split("=") if "=" in m else (m, m) for m in members.split()]
    vocabulary = enum.Enum(name, dict(pairs), type=str, module=__name__)
    vocabulary.__doc__ = doc
    return vocabulary


# Accelerate's other vocabularies (accelerate.utils), compared equal to their values as its are.
PrecisionType = _vocabulary("PrecisionType", "NO=no FP8=fp8 FP16=fp16 BF16=bf16", "mixed_precision's values.")
RNGType = _vocabulary(
    "RNGType",
    "TORCH=torch CUDA=cuda MLU=mlu SDAA=sdaa MUSA=musa NPU=npu XLA=xla XPU=xpu HPU=hpu "
    "NEURON=neuron GENERATOR=generator",
    "The random generators synchronize_rng_states can set.",
)
LoggerType = _vocabulary(
    "LoggerType",
    "ALL=all AIM=aim TENSORBOARD=tensorboard WANDB=wandb TRACKIO=trackio COMETML=comet_ml "
    "MLFLOW=mlflow CLEARML=clearml DVCLIVE=dvclive SWANLAB=swanlab",
    "log_with's tracker names.",
)
DynamoBackend = _vocabulary(
    "DynamoBackend",
    "NO EAGER AOT_EAGER INDUCTOR AOT_TS_NVFUSER NVPRIMS_NVFUSER CUDAGRAPHS OFI FX2TRT "
    "ONNXRT TENSORRT AOT_TORCHXLA_TRACE_ONCE TORCHXLA_TRACE_ONCE TVM HPU_BACKEND NEURON",
    "torch.compile backends by Accelerate's names (dynamo_backend).",
)
ComputeEnvironment = _vocabulary("ComputeEnvironment", "LOCAL_MACHINE AMAZON_SAGEMAKER", "Where a job runs.")
SageMakerDistributedType = _vocabulary(
    "SageMakerDistributedType",
    "NO DATA_PARALLEL MODEL_PARALLEL",
    "SageMaker's kinds of distribution (lowbit launches no SageMaker jobs).",
)

# Accelerate's top-level names for jobs lowbit does not do (``lowbit.<name>`` raises), and what to use.
NOT_OFFERED_AT_TOP_LEVEL = {
    "prepare_pippy": "pipeline parallelism (PiPPy) is not offered by lowbit; use FSDP2 or tensor parallelism "
    "(ParallelismConfig), or Accelerate for pipelines",
    "commands": "accelerate's CLI commands are lowbit's own CLI here: use `lowbit launch`, `lowbit config`, `lowbit "
    "env`",
    "checkpointing": "accelerate.checkpointing holds the insides of save_state/load_state; call "
    "accelerator.save_state / accelerator.load_state",
}
