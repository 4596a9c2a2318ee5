"""Will FP8 pay on this GPU? A prediction per Linear layer and for the whole training step.

torchao's derivation (``torchao/float8/README.md``): a Linear gains from FP8 when its bf16 GEMM
time exceeds its FP8 GEMM time plus the amax/cast/transpose traffic the recipe adds. Here:

* **GEMMs**: each Linear runs three (output, grad-input, grad-weight); each takes the longest of
  its compute at the format's peak times an achievable fraction, its bytes at the memory
  bandwidth times an achievable fraction, and a kernel-launch floor (the roofline of torchao's
  ``benchmarks/float8/utils/roofline_utils.py``, whose H100 constants are used: 78 % of the
  tensor-core peak, 92 % of the memory bandwidth, 2 us per kernel).
* **Casts**: per recipe, the bytes each kernel reads and writes per element of the input, the
  weight and the output gradient, as the backend that runs the recipe declares them
  (``BackendDescription.recipe_costs``, a :class:`~lowbit.kernel.types.RecipeCost` per recipe).
* **The rest of the step**, unchanged by FP8: attention (FLOPs counted from the model, at
  FlashAttention-2's share of the peak), the pointwise work between GEMMs (bytes counted from
  the model, fused as ``torch.compile`` fuses it, or op by op when eager), the loss, and AdamW's
  update. Communication is taken as overlapped with compute (FSDP2 prefetches).

Calibration and validation, with sources: docs/fp8-payoff.md.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lowbit.kernel.errors import ConfigError, did_you_mean
from lowbit.kernel.notices import LowbitNote, note
from lowbit.kernel.types import BF16_BYTES, RecipeCost

from lowbit.runtime.nests import tensor_leaves
from lowbit.runtime.observe.gpu_specs import GPU_PEAKS, DevicePeak, gpu_peak

# torchao roofline_utils.py (H100, "experimental observation with sample large inputs"; torchao
# reuses them for B200 and MI300X): the share of the tensor-core peak a large bf16 GEMM reaches,
# of the memory bandwidth a large pointwise kernel reaches, and the time of the smallest kernel.
GEMM_ACHIEVABLE = 0.78
MEMORY_ACHIEVABLE = 0.92
KERNEL_FLOOR_S = 2e-6
# An FP8 GEMM reaches this share of what a bf16 GEMM of the same shape reaches. Calibrated on
# torchao's published H100 microbenchmark (float8_roofline.py method: a tensorwise Linear's
# forward and backward, compiled, M, K, N = 4096, 8192, 16384 measured 1.39x over bf16), with
# the memory bandwidth of the H100 it ran on (2.4 TB/s, roofline_utils.py). docs/fp8-payoff.md.
FP8_GEMM_SHARE = 0.888
# FlashAttention-2 reaches 35 % of an H100's bf16 peak (Shah et al. 2024, FlashAttention-3,
# arXiv 2407.08608, abstract); its backward does 2.5x the forward's FLOPs (five matmuls to two).
ATTENTION_ACHIEVABLE = 0.35
ATTENTION_BACKWARD = 2.5
# Pointwise work in the backward reads the saved inputs and the incoming gradient and writes the
# outgoing one: taken as twice the forward's bytes.
POINTWISE_BACKWARD = 2.0
# AdamW's update in fp32: reads weight, gradient and two moments, writes weight and moments.
ADAMW_BYTES_PER_PARAMETER = 28
# Activation checkpointing: which forward work runs again in the backward, as shares of
# (Linear forward GEMMs, attention forward, pointwise forward). "op" is torchtitan's per-op
# selective checkpointing (every other matmul's output saved, attention saved, the rest recomputed).
RECOMPUTE = {"none": (0.0, 0.0, 0.0), "op": (0.5, 0.0, 1.0), "full": (1.0, 1.0, 1.0)}


@dataclass(frozen=True)
class LinearShape:
    """One Linear (or transformers Conv1D) call: ``tokens`` rows (M) of ``in_features`` (K) to ``out_features`` (N)."""

    name: str
    tokens: int
    in_features: int
    out_features: int
    # its weight needs no gradient (a LoRA base): two GEMMs a step, and in FP8 no per-step weight cast
    frozen: bool = False


@dataclass
class ModelWork:
    """What one forward of the model does, counted on the meta device."""

    linears: list[LinearShape]
    attention_flops: float = 0.0  # forward, causal masks counted as half
    other_gemm_flops: float = 0.0  # forward matmuls outside the Linear layers and attention
    pointwise_bytes: float = 0.0  # fused as torch.compile fuses: each region's reads and writes once
    pointwise_bytes_eager: float = 0.0  # op by op
    parameters: int = 0


@dataclass
class LayerPrediction:
    layer: LinearShape
    bf16_s: float
    low_s: float | None  # None: the layer stays in bf16 (the rule that keeps it is in ``kept``)
    kept: str = ""


@dataclass
class StepPrediction:
    gpu: DevicePeak
    recipe: str
    layers: list[LayerPrediction]
    other_s: dict[str, float] = field(default_factory=dict)  # the work FP8 does not change

    @property
    def bf16_step_s(self) -> float:
        return sum(p.bf16_s for p in self.layers) + sum(self.other_s.values())

    @property
    def low_step_s(self) -> float:
        return sum(p.bf16_s if p.low_s is None else p.low_s for p in self.layers) + sum(self.other_s.values())

    @property
    def speedup(self) -> float:
        return self.bf16_step_s / self.low_step_s


def known_gpu(name: str) -> DevicePeak:
    """The table's GPU for a name a user typed ("h100", "B200"), or a ConfigError listing them."""
    peak = gpu_peak(name.replace("_", " "))
    if peak is None or peak.memory_tbps is None:
        names = [p.name for p in GPU_PEAKS]
        raise ConfigError(f"no figures for GPU {name!r}.{did_you_mean(name, names)} Known: {', '.join(names)}.")
    return peak


def gpu_has_format(gpu: DevicePeak, cost: RecipeCost, recipe: str) -> None:
    """A ConfigError when ``gpu`` has no tensor cores for the recipe's format."""
    if _format_peak(gpu, cost.format) is None:
        raise ConfigError(
            f"the {gpu.name} has no {cost.format.upper()} tensor cores, so {recipe} would run emulated "
            "(slower than bf16). Pick a GPU that has them (`lowbit fp8-payoff --help` lists the GPUs)."
        )


def _format_peak(gpu: DevicePeak, fmt: str) -> float | None:
    return {"bf16": gpu.tflops, "fp8": gpu.fp8_tflops, "fp4": gpu.fp4_tflops}[fmt]


def _bandwidth(gpu: DevicePeak) -> float:
    return gpu.memory_tbps * 1e12 * MEMORY_ACHIEVABLE


def gemm_seconds(
    m: int,
    k: int,
    n: int,
    gpu: DevicePeak,
    fmt: str = "bf16",
    share: float = 1.0,
    value_bytes: float = BF16_BYTES,
    block: int | None = None,
) -> float:
    """One (m x k) @ (k x n) GEMM: compute, memory (operands in ``value_bytes``, scales one byte per
    ``block``, the output in bf16) or the launch floor, whichever is longest."""
    compute = 2 * m * k * n / (_format_peak(gpu, fmt) * 1e12 * GEMM_ACHIEVABLE * share)
    operand_bytes = value_bytes + (1 / block if block else 0)
    memory = ((m * k + k * n) * operand_bytes + m * n * BF16_BYTES) / _bandwidth(gpu)
    return max(compute, memory, KERNEL_FLOOR_S)


def _three_gemms(layer: LinearShape, gpu: DevicePeak, cost: RecipeCost | None, forward_again: float) -> float:
    m, k, n = layer.tokens, layer.in_features, layer.out_features
    shapes = ((m, k, n), (m, n, k), (k, m, n))  # output, grad-input, grad-weight
    if layer.frozen:  # no weight gradient: autograd skips it in bf16, a frozen FP8 base never computes it
        shapes = shapes[:2]
    total = 0.0
    for index, shape in enumerate(shapes):
        if cost is not None and cost.low_precision[index]:
            seconds = gemm_seconds(
                *shape, gpu, cost.format, FP8_GEMM_SHARE * cost.gemm_share, cost.value_bytes, cost.block
            )
        else:
            seconds = gemm_seconds(*shape, gpu)
        total += seconds * (1 + forward_again if index == 0 else 1)
    return total


def cast_seconds(layer: LinearShape, gpu: DevicePeak, cost: RecipeCost, compiled: bool, forward_again: float) -> float:
    """The recipe's casts of this layer's three tensors, each kernel at least the launch floor;
    a recomputed forward casts its input and weight again."""
    sizes = {
        "input": layer.tokens * layer.in_features,
        "weight": layer.in_features * layer.out_features,
        "grad_output": layer.tokens * layer.out_features,
    }
    total = 0.0
    for role, kernels in cost.cast_bytes.items():
        if role == "weight" and layer.frozen:  # a frozen FP8 base is quantized once, at prepare()
            continue
        seconds = 0.0
        for index, per_element in enumerate(kernels):
            if index == 0 and compiled and cost.fusable_read and role != "weight":
                per_element -= BF16_BYTES
            if per_element > 0:
                seconds += max(per_element * sizes[role] / _bandwidth(gpu), KERNEL_FLOOR_S)
        total += seconds * (1 + forward_again if role != "grad_output" else 1)
    return total


def predict(
    work: ModelWork,
    gpu: DevicePeak,
    recipe: str,
    cost: RecipeCost,
    keep: dict[str, str] | None = None,
    compiled: bool = True,
    recompute: str = "none",
    shards: int = 1,
    auto: bool = False,
) -> StepPrediction:
    """The step's time in bf16 and with ``recipe`` (costing ``cost``): per Linear, and the rest
    unchanged. ``keep``: layers that stay in bf16, with why; ``auto``: also keep those the
    prediction finds slower in the recipe."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"unknown activation checkpointing {recompute!r}; one of {', '.join(RECOMPUTE)}.")
    gpu_has_format(gpu, cost, recipe)
    linear_again, attention_again, pointwise_again = RECOMPUTE[recompute]
    keep = dict(keep or {})
    layers = []
    for layer in work.linears:
        bf16 = _three_gemms(layer, gpu, None, linear_again)
        low = _three_gemms(layer, gpu, cost, linear_again) + cast_seconds(layer, gpu, cost, compiled, linear_again)
        reason = keep.get(layer.name, "")
        if not reason and (layer.in_features % 16 or layer.out_features % 16):
            reason = "dims not divisible by 16"
        if not reason and auto and low >= bf16:
            reason = "auto: predicted slower in FP8"
        layers.append(LayerPrediction(layer, bf16, None if reason else low, reason))
    attention = work.attention_flops * (1 + ATTENTION_BACKWARD + attention_again)
    other_gemms = 3 * work.other_gemm_flops / (gpu.tflops * 1e12 * GEMM_ACHIEVABLE)
    pointwise = work.pointwise_bytes if compiled else work.pointwise_bytes_eager
    other = {
        "attention": attention / (gpu.tflops * 1e12 * ATTENTION_ACHIEVABLE),
        "other GEMMs": other_gemms,
        "pointwise": pointwise * (1 + POINTWISE_BACKWARD + pointwise_again) / _bandwidth(gpu),
        "optimizer": work.parameters / max(shards, 1) * ADAMW_BYTES_PER_PARAMETER / _bandwidth(gpu),
    }
    return StepPrediction(gpu, recipe, layers, other)


# --- counting the model's work on the meta device --------------------------------------------

# Each a GEMM of 2 x (elements of A) x (columns of B) FLOPs; grouped GEMMs (MoE experts) too, the
# groups partitioning A's rows (or, for the weight gradient, the shared inner dim).
_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"}
# Namespaces of the ops whose work the tracer knows (anything else, a library's custom op such as
# flash-attn's or Transformer Engine's, has work it cannot see: the count is refused, never short).
_KNOWN_NAMESPACES = {"aten", "prim", "prims"}


class UncountableForward(Exception):
    """The forward's work cannot be counted from shapes alone; the message says what and why."""


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, transformers' Conv1D, and a backend's Linear of its own (a frozen FP8 base, TE's
    Linear): a module with in/out features and a 2-D weight."""
    if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return True
    weight = getattr(module, "weight", None)
    return hasattr(module, "in_features") and hasattr(module, "out_features") and getattr(weight, "ndim", 0) == 2


class _WorkCounter(TorchFunctionMode):
    """Counts attention by its shapes (never running it) and notes each Linear call."""

    def __init__(self, tracer: "_PointwiseTracer", causal: bool) -> None:
        super().__init__()
        self.tracer, self.causal, self.attention_flops = tracer, causal, 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            query, key, value = args[:3]
            causal = kwargs.get("is_causal", False) or self.causal
            pairs = query.shape[-2] * key.shape[-2] / (2 if causal else 1)
            heads = query.numel() // (query.shape[-2] * query.shape[-1])
            self.attention_flops += 2 * heads * pairs * (query.shape[-1] + value.shape[-1])
            out = query.new_empty((*query.shape[:-1], value.shape[-1]))  # a mode is off inside its own handler
            self.tracer.boundary(out, 1 + max(self.tracer.level_of(t) for t in (query, key, value)))
            return out
        return func(*args, **kwargs)


class _PointwiseTracer(TorchDispatchMode):
    """Sorts the aten ops between the GEMMs into regions (ops that no GEMM separates, which
    torch.compile can fuse) and counts the bytes each region reads from and writes for outside."""

    def __init__(self) -> None:
        super().__init__()
        self.level: dict[int, int] = {}  # tensor id -> GEMMs on the longest path to it
        self.region_of: dict[int, int | None] = {}  # tensor id -> region that wrote it (None: a GEMM, input or weight)
        self.size: dict[int, int] = {}
        self.alias: dict[int, int] = {}
        self.reads: set[tuple[int, int]] = set()  # (region, tensor) pairs read across a boundary
        self.read_outside: set[int] = set()  # pointwise-written tensors read by another region or a GEMM
        self.eager_bytes = 0
        self.other_gemm_flops = 0.0
        self.in_linear = 0
        self.seen: list[Any] = []  # holds every tensor seen, so that ids are never reused
        # Why the count would be wrong, if it would: a value read on the host, an op of unknown work.
        self.uncountable: list[str] = []

    def _root(self, tensor: torch.Tensor) -> int:
        key = id(tensor)
        if key not in self.level:
            self.seen.append(tensor)
            self.level[key], self.region_of[key] = 0, None
            # Activations as the bf16 run has them, whatever dtype the counted copy is in.
            width = BF16_BYTES if tensor.is_floating_point() else tensor.element_size()
            self.size[key] = tensor.numel() * width
        return self.alias.get(key, key)

    def level_of(self, tensor: torch.Tensor) -> int:
        return self.level[self._root(tensor)]

    def boundary(self, tensor: torch.Tensor, level: int) -> None:
        """A GEMM's or attention's output, at ``level``: the next region starts after it."""
        key = self._root(tensor)
        self.level[key], self.region_of[key] = level, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.name() == "aten::_local_scalar_dense":
            # A value read on the host has no value on meta. A yes/no check (transformers' test for
            # packed sequences) takes the plain path (true); a number may size the work that follows
            # (``.item()`` as a shape), which a shape-only count cannot know.
            if args[0].dtype != torch.bool:
                self.uncountable.append(
                    "it reads a tensor's value on the host (.item(), int(t)), which may size its "
                    "work, and a count from shapes alone cannot know it"
                )
            return True if args[0].dtype == torch.bool else 1
        if func.namespace not in _KNOWN_NAMESPACES:
            self.uncountable.append(f"it calls {func.name()}, a custom op whose work lowbit cannot see")
        out = func(*args, **kwargs)
        inputs = list(tensor_leaves((args, kwargs)))
        outputs = list(tensor_leaves(out))
        roots = [self._root(t) for t in inputs]
        level = max((self.level[r] for r in roots), default=0)
        name = func.overloadpacket.__name__
        if func.is_view or name in ("detach", "alias", "_unsafe_view", "view", "t", "transpose", "expand"):
            for t in outputs:
                self._root(t)
                self.alias[id(t)] = roots[0] if roots else id(t)
            return out
        if name in _GEMM_OPS or self.in_linear:
            for r in roots:
                if self.region_of[r] is not None:
                    self.read_outside.add(r)
            if name in _GEMM_OPS and not self.in_linear:
                a, b = inputs[-2:] if name in ("addmm", "baddbmm") else inputs[:2]  # after the bias / before scales
                self.other_gemm_flops += 2 * a.numel() * b.shape[-1]
            for t in outputs:
                self.boundary(t, level + 1)
            return out
        lookup = name == "embedding"  # reads the rows it gathers (as many bytes as it writes), not the table
        read = roots[1:] if lookup else roots
        for r in read:
            if self.region_of[r] != level:
                self.reads.add((level, r))
                if self.region_of[r] is not None:
                    self.read_outside.add(r)
        self.eager_bytes += sum(self.size[r] for r in read)
        for t in outputs:
            key = self._root(t)
            self.level[key], self.region_of[key] = level, level
            self.eager_bytes += self.size[key] * (2 if lookup else 1)
            if lookup:
                self.reads.add((level, key))
        return out

    def fused_bytes(self, outputs: Iterable[torch.Tensor]) -> int:
        """Each region's reads of tensors from outside it, and its writes that are read outside
        it (or are the model's outputs); a lookup reads only what it gathers."""
        written = self.read_outside | {self._root(t) for t in outputs if self.region_of.get(self._root(t)) is not None}
        return sum(self.size[r] for _, r in self.reads) + sum(self.size[r] for r in written)


def count_work(model: nn.Module, batch_size: int, seq_len: int, causal: bool | None = None) -> ModelWork:
    """Count the work of one forward of ``model`` on a ``batch_size`` x ``seq_len`` example batch
    (:func:`trace_work`). ``causal``: count attention as causal (None: when the model is a
    transformers causal LM)."""
    from lowbit.runtime.observe.model_spec import example_inputs

    inputs = example_inputs(model, batch_size, seq_len, "meta")
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
    try:
        return trace_work(model, args, kwargs, causal)
    except Exception as exc:  # noqa: BLE001 - any model may refuse the example batch; say what was tried
        tried = (
            f"input_ids of shape ({batch_size}, {seq_len})"
            if isinstance(inputs, dict)
            else f"one float tensor of shape {tuple(inputs.shape)}"
        )
        raise ConfigError(
            f"{type(model).__name__} did not run on an example batch ({tried}): "
            f"{type(exc).__name__}: {exc}. Counting a model's work needs a forward that takes "
            "token ids (a transformers LM) or one tensor: give a module:factory returning a "
            "wrapper that builds its other inputs."
        ) from None


def trace_work(model: nn.Module, args: tuple, kwargs: dict[str, Any], causal: bool | None = None) -> ModelWork:
    """The work of one forward of ``model(*args, **kwargs)`` (meta tensors): each Linear's shape,
    attention FLOPs (grouped-query shapes included), other matmuls, and the pointwise bytes.
    Nothing runs: the forward is traced on the meta device with meta stand-ins for every weight
    and buffer, so the model's own tensors are neither read nor written (a BatchNorm's running
    statistics stay). A compiled model
    (or compiled blocks) is traced eagerly, its compiled code untouched: dynamo never meets a frame
    under the tracer, which would mark it to be skipped for good."""
    model = getattr(model, "_orig_mod", model)
    if causal is None:
        causal = type(model).__name__.endswith("ForCausalLM")
    tracer = _PointwiseTracer()
    counter = _WorkCounter(tracer, causal)
    linears: list[LinearShape] = []
    names = {module: name for name, module in model.named_modules()}
    # read before the trace: under it the weights are meta stand-ins, none needing a gradient
    frozen = {module for module in names if _is_linear(module) and not module.weight.requires_grad}
    handles = []

    def before(module, args):
        tracer.in_linear += 1

    def after(module, args, output):
        tracer.in_linear -= 1
        width = args[0].shape[-1]
        linears.append(LinearShape(names[module], args[0].numel() // width, width, output.shape[-1], module in frozen))

    for module in names:
        if _is_linear(module):
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        # compiled code (a compiled model or blocks) runs as plain eager code inside
        with torch.compiler.set_stance("force_eager"), counter, tracer, torch.no_grad():
            stand_ins = {
                name: _meta_like(tensor) for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            }
            out = torch.func.functional_call(model, stand_ins, args, kwargs)
            outputs = list(tensor_leaves(out))
            pointwise = tracer.fused_bytes(outputs)
    finally:
        for handle in handles:
            handle.remove()
    if tracer.uncountable:
        raise UncountableForward("; ".join(dict.fromkeys(tracer.uncountable)))
    return ModelWork(
        linears,
        counter.attention_flops,
        tracer.other_gemm_flops,
        pointwise,
        tracer.eager_bytes,
        sum(_meta_like(p).numel() for p in model.parameters()),
    )


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s whole shape and dtype (a DeepSpeed ZeRO-3 partition's ``ds_shape``)."""
    return torch.empty(getattr(tensor, "ds_shape", None) or tensor.shape, dtype=tensor.dtype, device="meta")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s structure whose every tensor is a meta tensor: no memory, and tracing it
    touches nothing of the model (no strategy hook, no compiled code, no state, no hook of the user's).

    Not only parameters and buffers: any tensor the copy meets (a plain attribute such as a rotary
    cache, a tensor in a list) becomes a meta tensor of its shape, so the copy allocates nothing on
    any device. Hooks registered on the model (a logging hook, a counter, one that calls ``.cpu()``)
    are left out of the copy unless torch's own (weight norm, pruning): the count runs no code of the
    user's but the modules' forwards."""
    import copy

    model = getattr(model, "_orig_mod", model)
    generators = [
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if isinstance(value, torch.Generator)
    ]
    if generators:  # torch cannot copy one into a meta copy (its state is not a tensor)
        raise ValueError(
            f"the model holds a torch.Generator ({', '.join(generators[:3])}), which a meta copy of it cannot hold"
        )
    with _tensors_copied_as_meta():
        copied = copy.deepcopy(model)
    for module in copied.modules():
        # A forward set on an instance (TRL's SFTTrainer, Accelerate's autocast, a script's patch) often
        # closes over the original module's bound forward, which a copy cannot rebind: tracing it would
        # run the original model. The copy counts its class's forward, the model's own computation.
        module.__dict__.pop("forward", None)
        for hooks in _HOOK_DICTS:
            table = getattr(module, hooks, None)
            if isinstance(table, dict):
                for key in [key for key, hook in table.items() if not _is_torchs_own(hook)]:
                    del table[key]
    return copied


# nn.Module's hook tables (each an ordered dict id -> hook) that run during a forward or backward.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _is_torchs_own(hook: Any) -> bool:
    """A hook torch registers as part of a module's computation (weight norm, spectral norm, pruning)."""
    owner = getattr(hook, "__module__", None) or getattr(type(hook), "__module__", "")
    return owner.startswith("torch.")


@contextlib.contextmanager
def _tensors_copied_as_meta():
    """Within: ``copy.deepcopy`` turns each tensor into a meta tensor of its (whole) shape and dtype,
    a Parameter into a meta Parameter. Patched on the classes for the copy's length: the memo of a
    deepcopy only reaches the tensors it is told of, and a model's plain tensor attributes are not."""

    def tensor_copy(tensor, memo):
        meta = _meta_like(tensor)
        memo[id(tensor)] = meta
        return meta

    def parameter_copy(param, memo):
        meta = nn.Parameter(_meta_like(param), requires_grad=param.requires_grad)
        memo[id(param)] = meta
        return meta

    saved = torch.Tensor.__deepcopy__, nn.Parameter.__deepcopy__
    torch.Tensor.__deepcopy__, nn.Parameter.__deepcopy__ = tensor_copy, parameter_copy
    try:
        yield
    finally:
        torch.Tensor.__deepcopy__, nn.Parameter.__deepcopy__ = saved


def first_last(work: ModelWork) -> dict[str, str]:
    """lowbit's default: the model's first and last Linear stay in high precision."""
    names = list(dict.fromkeys(layer.name for layer in work.linears))
    return {names[0]: "first Linear", names[-1]: "last Linear"} if names else {}


# --- the table --------------------------------------------------------------------------------


def _group(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def table(prediction: StepPrediction) -> str:
    """Per Linear (the same layer in every block on one row), then the rest of the step, then the
    predicted speedup, last."""
    rows: dict[tuple, list[LayerPrediction]] = {}
    for p in prediction.layers:
        key = (_group(p.layer.name), p.layer.tokens, p.layer.in_features, p.layer.out_features, p.kept)
        rows.setdefault(key, []).append(p)
    lines = [
        f"{'layer':<40} {'count':>5} {'M x K x N':>22} {'bf16 ms':>9} {prediction.recipe + ' ms':>14} {'speedup':>8}"
    ]
    for (name, m, k, n, kept), group in rows.items():
        bf16 = sum(p.bf16_s for p in group) * 1e3
        low = "bf16: " + kept if kept else f"{sum(p.low_s for p in group) * 1e3:.3f}"
        speed = f"{bf16 / float(low):.2f}x" if not kept else "-"
        name = group[0].layer.name if len(group) == 1 else name
        lines.append(f"{name:<40} {len(group):>5} {f'{m}x{k}x{n}':>22} {bf16:>9.3f} {low:>14} {speed:>8}")
    for part, seconds in prediction.other_s.items():
        if seconds:
            lines.append(
                f"{part + ' (unchanged)':<40} {'':>5} {'':>22} {seconds * 1e3:>9.3f} {seconds * 1e3:>14.3f} "
                f"{'1.00x':>8}"
            )
    lines.append(
        f"step: bf16 {prediction.bf16_step_s * 1e3:.1f} ms, {prediction.recipe} {prediction.low_step_s * 1e3:.1f} ms "
        f"on one {prediction.gpu.name}"
    )
    lines.append(f"predicted step speedup: {prediction.speedup:.2f}x")
    return "\n".join(lines)


# --- the automatic layer filter ---------------------------------------------------------------

AUTO_FILTER_FALLBACK_GPU = "H100"


class AutoFilterNotice(LowbitNote):
    """Said when the automatic layer filter judges for a GPU other than the run's."""


def slower_layers(
    shapes: dict[str, tuple[int, int]], tokens: int, device_name: str, recipe: str, cost: RecipeCost, compiled: bool
) -> dict[str, str]:
    """``layer_filter="auto"``: the layers (name -> (in_features, out_features)) whose GEMMs and
    casts the prediction finds no faster in ``recipe`` than in bf16 at ``tokens`` rows, with why.
    Judged for the run's GPU; off the table (a CPU, an unknown GPU), for an H100, said once."""
    gpu = gpu_peak(device_name)
    if gpu is None or gpu.memory_tbps is None or _format_peak(gpu, cost.format) is None:
        gpu = known_gpu(AUTO_FILTER_FALLBACK_GPU)
        note(
            f"layer_filter='auto' judges each layer for the {gpu.name}: lowbit has no {recipe} figures for "
            f"{device_name}.",
            AutoFilterNotice,
        )
    gpu_has_format(gpu, cost, recipe)
    slower = {}
    for name, (k, n) in shapes.items():
        layer = LinearShape(name, tokens, k, n)
        bf16 = _three_gemms(layer, gpu, None, 0.0)
        low = _three_gemms(layer, gpu, cost, 0.0) + cast_seconds(layer, gpu, cost, compiled, 0.0)
        if low >= bf16:
            slower[name] = f"auto: predicted {bf16 / low:.2f}x in {recipe} on the {gpu.name} at {tokens} tokens"
    return slower


# --- the FP8 report's prediction at prepare() -------------------------------------------------

# The FP8 report predicts at this many tokens per micro-batch (torchtitan's Llama-3 setting);
# ``lowbit fp8-payoff --tokens`` predicts at the user's own.
REPORT_TOKENS = 8192


def report_work(model: nn.Module, device_name: str) -> ModelWork | None:
    """Before conversion, on a GPU lowbit has figures for: the model's work at ``REPORT_TOKENS``
    tokens (its sequence length capped by the model's ``max_position_embeddings``); the Linear
    layers alone when a forward cannot be traced from an example batch. None elsewhere."""
    gpu = gpu_peak(device_name)
    if gpu is None or gpu.memory_tbps is None:
        return None
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or REPORT_TOKENS
    seq_len = min(REPORT_TOKENS, limit)
    try:
        return count_work(model, max(REPORT_TOKENS // seq_len, 1), seq_len)
    except ConfigError:  # the model refused the example batch: its Linears still tell
        names = [(name, m) for name, m in model.named_modules() if _is_linear(m)]
        return ModelWork(
            [LinearShape(name, REPORT_TOKENS, *_dims(m), not m.weight.requires_grad) for name, m in names],
            parameters=sum(p.numel() for p in model.parameters()),
        )


def _dims(module: nn.Module) -> tuple[int, int]:
    return (module.in_features, module.out_features) if isinstance(module, nn.Linear) else tuple(module.weight.shape)


def report_prediction(
    work: ModelWork | None,
    device_name: str,
    recipe: str | None,
    costs: dict[str, RecipeCost],
    kept: dict[str, str],
    compiled: bool,
) -> str:
    """The FP8 report's last clause: the predicted step speedup on this GPU, or '' (no figures:
    the backend declares no cost for the recipe, or the GPU has no tensor cores for its format)."""
    cost = costs.get(recipe or "")
    gpu = gpu_peak(device_name)
    if work is None or cost is None or gpu is None or _format_peak(gpu, cost.format) is None:
        return ""
    prediction = predict(work, gpu, recipe, cost, keep=kept, compiled=compiled)
    what = "step" if work.attention_flops or work.pointwise_bytes else "Linear layers (a forward could not be traced)"
    return (
        f"predicted {what} {prediction.speedup:.2f}x over bf16 on this {gpu.name} at {REPORT_TOKENS} tokens per "
        f"micro-batch, {'compiled' if compiled else 'eager'} (`lowbit fp8-payoff` predicts at yours)"
    )
