"""FP8 GEMMs where the hardware has none: the exact fp8 values, multiplied at bf16 (or fp32) speed.

torchao's own emulation (``emulate=True``) converts both fp8 operands to fp32, divides each by
its scale and multiplies in fp32, so an emulated FP8 step costs an fp32 step plus two slow
fp8-to-fp32 conversions (about 7 ms per million elements on a 2-core x86 CPU in eager mode).

This path follows the order an FP8 tensor core uses instead: multiply the fp8 values themselves,
accumulate, then apply both scales once to the output. Every e4m3 and e5m2 value is exact in bf16
and fp32, and the product of two is exact in fp32, so the GEMM runs in bf16 where bf16 GEMMs are
fast (CUDA GPUs without FP8, CPUs with AVX512-BF16 or AMX) and in fp32 elsewhere; both accumulate
in fp32. The fp8 values are widened with integer bit operations (a few vectorised passes, about
7x faster than torch's fp8 conversion on CPU) rather than a dtype conversion.

Numerics against ``torch._scaled_mm`` (the reference): in fp32 the same products and one final
rounding (measured: bf16 outputs bit for bit equal); in bf16 the GEMM rounds its output to bf16
before the scales are applied, a second rounding (at most 1 bf16 ulp, on about a quarter of the
elements). bf16 GEMMs are used for bf16 outputs only; wider outputs get fp32 GEMMs.
``tests/plugins/ao/test_fast_emulation.py`` measures both.

torchao has no hook for a GEMM implementation, so lowbit wraps the three entries of its float8
op table that run GEMMs (``mm``, ``matmul``, ``addmm``). The wrapper acts only on tensors whose
layer lowbit marked (their ``ScaledMMConfig`` is one of ``marker_class``'s): it holds them to
CUDA's shape rule (``gemm_rules``), then takes this path or torchao's own function as the mark
says. Every other Float8 tensor goes to torchao's own function, unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lowbit.kernel.plugin_api import cpu_has_native_bf16

from lowbit_ao.gemm_rules import check_scaled_mm_shapes

# fp8 dtype -> (left shift that puts its exponent and mantissa in bf16's place, 2^(127 - its bias))
_WIDEN = {torch.float8_e4m3fn: (4, 2.0**120), torch.float8_e5m2: (5, 2.0**112)}


def exact_values(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of an fp8 tensor in ``dtype`` (bfloat16 or float32), exactly, by bit operations.

    The sign goes to bf16's sign bit and exponent and mantissa are shifted into bf16's layout (its
    exponent field then holds the fp8 one); one multiplication by a power of two moves the
    exponent bias, and fp32 is bf16 widened (measured on a 2-core x86 CPU, per million elements:
    about 1 ms, against 7 ms for torch's fp8-to-fp32 conversion and 3.3 ms for the same bit
    operations on 32-bit integers). fp8 subnormals become bf16 subnormals before the multiplication
    and come out exact, unless denormals are flushed (``torch.set_flush_denormal(True)``): then
    they read as zero, as on hardware that flushes them.
    """
    shift, rebias = _WIDEN[data.dtype]
    bits = data.view(torch.uint8).to(torch.int16)
    wide = (bits & 0x80) << 8
    wide |= (bits & 0x7F) << shift
    values = wide.view(torch.bfloat16).mul_(rebias)
    return values if dtype == torch.bfloat16 else values.to(dtype)


def scaled_mm(a: Any, b: Any, output_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` for two torchao Float8 tensors: fp8 values multiplied in ``compute_dtype``, then
    both scales applied to the output in fp32. The scales are per tensor, or per row of ``a`` and
    per column of ``b`` (rowwise recipes), so they factor out of every dot product."""
    a_scale, b_scale = a._scale, b._scale
    if a_scale.dim() == 2 and a_scale.shape[1] != 1 or b_scale.dim() == 2 and b_scale.shape[0] != 1:
        raise ValueError(
            f"fast FP8 emulation needs per-tensor, per-row (a) or per-column (b) scales; "
            f"got {tuple(a_scale.shape)} and {tuple(b_scale.shape)}"
        )
    product = torch.mm(exact_values(a._data, compute_dtype), exact_values(b._data, compute_dtype)).float()
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        product.mul_(a_scale.reciprocal() * b_scale.reciprocal())
    else:
        product.mul_(a_scale.reciprocal()).mul_(b_scale.reciprocal())
    return product.to(output_dtype)


def gemm_dtype(marked: torch.dtype, output_dtype: torch.dtype) -> torch.dtype:
    """bf16 GEMMs only for bf16 outputs: a wider output gets the fp32 GEMM, so the result is
    never less precise than its own dtype (lowbit runs FP8 inside bf16 autocast: bf16 outputs)."""
    return marked if output_dtype == torch.bfloat16 else torch.float32


def _checked_gemm(original, choose_config, aten_op, args, kwargs, a, b, bias=None):
    """A marked layer's GEMM: held to CUDA's shape rule, then the fast emulation where the marker
    names a compute dtype, else torchao's own function (its emulation, or torch._scaled_mm).
    ``choose_config`` is torchao's ``choose_scaled_mm_config``."""
    config = choose_config(a._gemm_input_role, a._linear_mm_config, b._gemm_input_role, b._linear_mm_config)
    marker = type(config)
    if not getattr(marker, "lowbit_marked", False):  # a layer lowbit did not convert: torchao's path, unchecked
        return original(aten_op, args, kwargs)
    check_scaled_mm_shapes(a, b, config.pad_inner_dim)
    if not torch.autograd._profiler_enabled():
        return _gemm(original, marker, aten_op, args, kwargs, a, b, bias)
    # Under a profiler, each FP8 GEMM (a dozen small operations when emulated) is one named range.
    label = "emulated" if marker.lowbit_compute_dtype is not None or getattr(config, "emulate", False) else "scaled_mm"
    with torch.profiler.record_function(f"lowbit::fp8_gemm ({label})"):
        return _gemm(original, marker, aten_op, args, kwargs, a, b, bias)


def _gemm(original, marker, aten_op, args, kwargs, a, b, bias):
    if marker.lowbit_compute_dtype is None:
        return original(aten_op, args, kwargs)
    out = scaled_mm(a, b, a._orig_dtype, gemm_dtype(marker.lowbit_compute_dtype, a._orig_dtype))
    return out if bias is None else out + bias


def _mm(original, choose_config, aten_op, args, kwargs=None):
    return _checked_gemm(original, choose_config, aten_op, args, kwargs, args[0], args[1])


def _addmm(original, choose_config, aten_op, args, kwargs=None):
    return _checked_gemm(original, choose_config, aten_op, args, kwargs, args[1], args[2], bias=args[0])


def _install_op_wrappers() -> None:
    """Wrap torchao's float8 mm/matmul/addmm once per process (idempotent)."""
    from torchao.float8 import float8_ops

    table = float8_ops.FLOAT8_OPS_TABLE
    aten = torch.ops.aten
    for op, wrapper in ((aten.mm.default, _mm), (aten.matmul.default, _mm), (aten.addmm.default, _addmm)):
        current = table[op]
        if getattr(current, "_lowbit_fast_emulation", False):
            continue
        wrapped = functools.partial(wrapper, current, float8_ops.choose_scaled_mm_config)
        wrapped._lowbit_fast_emulation = True  # type: ignore[attr-defined]
        wrapped.__name__ = f"lowbit_fast_{op.__name__}"  # type: ignore[attr-defined]
        table[op] = wrapped


def compute_dtype_for(device: torch.device) -> torch.dtype:
    """bf16 where bf16 GEMMs are fast (CUDA; CPUs with AVX512-BF16 or AMX), else fp32.

    On an AVX2-only CPU a bf16 GEMM takes a slow path (a 512x512 matmul: 207 ms against 3.6 ms in
    fp32, measured), while fp32 is exact for fp8 products too."""
    if device.type == "cuda":
        return torch.bfloat16
    # unknown CPU features: fp32, exact too, and never the slow bf16 path
    return torch.bfloat16 if cpu_has_native_bf16(when_unknown=False) else torch.float32


_MARKERS: dict[Any, type] = {}


def marker_class(compute_dtype: torch.dtype | None) -> type:
    """A subclass of torchao's ScaledMMConfig that marks a layer lowbit converted off a real FP8 GPU:
    its GEMMs are held to CUDA's shape rule (:mod:`lowbit_ao.gemm_rules`), and run lowbit's fast
    emulation in ``compute_dtype`` (None: torchao's own function).

    As a tuple it equals torchao's config with the same fields (so torchao's consistency checks
    between the two operands pass); its class tells the op wrappers what to do."""
    if compute_dtype not in _MARKERS:
        from torchao.float8.float8_training_tensor import ScaledMMConfig

        label = str(compute_dtype).removeprefix("torch.") if compute_dtype is not None else "torchao"

        def __reduce__(self: Any) -> tuple[Any, tuple[Any, ...]]:
            # Made at run time, the class cannot be pickled by name (the distributed checkpoint of
            # FSDP2's float8 all-gather weights pickles their config): pickle how to remake it.
            return _remake_marked, (compute_dtype, tuple(self))

        # The distributed checkpoint's planner reads what it pickled back with weights_only=True.
        torch.serialization.add_safe_globals([_remake_marked])
        _MARKERS[compute_dtype] = type(
            f"CheckedMMConfig_{label}",
            (ScaledMMConfig,),
            {"__slots__": (), "lowbit_marked": True, "lowbit_compute_dtype": compute_dtype, "__reduce__": __reduce__},
        )
    return _MARKERS[compute_dtype]


def _remake_marked(compute_dtype: torch.dtype | None, fields: tuple[Any, ...]) -> Any:
    return marker_class(compute_dtype)(*fields)


def mark_converted_layers(model: nn.Module, compute_dtype: torch.dtype | None) -> int:
    """Mark every torchao Float8Linear of ``model`` (see :func:`marker_class`); returns how many.

    For the fast path their GEMM configs must already say ``emulate=True`` (torchao's fallback
    path, used if the mark is ever lost); the weight wrapper of FSDP float8 all-gather carries
    the config too."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import LinearMMConfig

    marked_class = marker_class(compute_dtype)
    _install_op_wrappers()
    count = 0
    for module in model.modules():
        if not isinstance(module, Float8Linear):
            continue
        config = module.linear_mm_config
        marked = LinearMMConfig(*(marked_class(*gemm) for gemm in config))
        module.linear_mm_config = marked
        if hasattr(module.weight, "_linear_mm_config"):
            module.weight._linear_mm_config = marked
        count += 1
    return count
