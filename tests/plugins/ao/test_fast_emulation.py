"""lowbit-ao's fast FP8 emulation: exact fp8 values, GEMMs in bf16/fp32, scales on the output.

The reference is ``torch._scaled_mm`` on CPU (torch's FP8 GEMM); torchao's own emulation stays
available (``emulation="torchao"``, bit for bit torchao: ``test_ao.py::test_parity_with_raw_torchao_is_bitwise``).
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("lowbit_ao")
pytest.importorskip("torchao.float8")

import torch  # noqa: E402
from helpers import mlp, regression_data  # noqa: E402
from torch import nn  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.utils import AORecipeKwargs  # noqa: E402

from lowbit_ao.fast_emulation import exact_values, mark_converted_layers, scaled_mm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::lowbit_ao.convert.EmulationNotice")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("wide", (torch.float32, torch.bfloat16))
def test_every_finite_fp8_value_is_widened_exactly(fp8, wide):
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8)
    reference = data.float()
    finite = torch.isfinite(reference)
    assert finite.sum() >= 248  # e4m3fn: 2 NaNs; e5m2: 2 infinities and 6 NaNs
    widened = exact_values(data, wide)
    assert widened.dtype == wide
    assert torch.equal(widened.float()[finite], reference[finite])
    assert torch.equal(torch.signbit(widened.float()[finite]), torch.signbit(reference[finite]))  # -0.0 too


def _operands(rows, inner, cols, rowwise, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, inner, generator=g) * torch.logspace(-3, 1, inner)  # a wide range: subnormals too
    w = torch.randn(cols, inner, generator=g)
    reduce = (lambda t: t.abs().amax(1, keepdim=True)) if rowwise else (lambda t: t.abs().max())
    a_scale, w_scale = 448 / reduce(a), 448 / reduce(w)
    a8 = (a * a_scale).to(torch.float8_e4m3fn)
    b8 = (w * w_scale).to(torch.float8_e4m3fn).t()  # column-major, as torchao passes the weight
    b_scale = w_scale.t() if rowwise else w_scale
    return a8, a_scale.float(), b8, b_scale.float()


def _bf16_ulps(out, ref):
    """|out - ref| in units of the bf16 spacing at ref."""
    ref = ref.float()
    exponent = torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126)))
    return (out.float() - ref).abs() / torch.exp2(exponent - 7)


@pytest.mark.parametrize("rowwise", (False, True), ids=("tensorwise", "rowwise"))
@pytest.mark.parametrize("shape", ((16, 32, 16), (64, 96, 48), (3, 48, 80)))
def test_fast_gemm_against_torch_scaled_mm(rowwise, shape):
    a8, a_scale, b8, b_scale = _operands(*shape, rowwise)
    reference = torch._scaled_mm(
        a8, b8, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=torch.bfloat16
    )
    a, b = SimpleNamespace(_data=a8, _scale=a_scale), SimpleNamespace(_data=b8, _scale=b_scale)
    # fp32 GEMM: the same exact products, one rounding to bf16: equal to the reference
    assert torch.equal(scaled_mm(a, b, torch.bfloat16, torch.float32), reference)
    # bf16 GEMM: rounded to bf16 once more before the scales: within 1 ulp, on a minority of elements
    ulps = _bf16_ulps(scaled_mm(a, b, torch.bfloat16, torch.bfloat16), reference)
    assert ulps.max() <= 1.0, ulps.max()
    assert (ulps > 0).float().mean() < 0.4  # measured 0.26-0.27 on (64, 96, 48)
    # fp32 output: fp32 GEMM; the sums may be added in another order (measured: up to 4e-6 absolute
    # where the largest output is ~10, i.e. a few fp32 ulps of the terms)
    reference32 = torch._scaled_mm(
        a8, b8, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=torch.float32
    )
    torch.testing.assert_close(
        scaled_mm(a, b, torch.float32, torch.float32),
        reference32,
        rtol=1e-5,
        atol=2e-6 * reference32.abs().max().item(),
    )


def test_a_column_scale_on_the_left_operand_is_refused():
    a8, _, b8, b_scale = _operands(4, 16, 8, rowwise=False)
    bad = SimpleNamespace(_data=a8, _scale=torch.ones(1, 16))
    with pytest.raises(ValueError, match=r"per-tensor, per-row \(a\) or per-column \(b\) scales; got \(1, 16\)"):
        scaled_mm(bad, SimpleNamespace(_data=b8, _scale=b_scale), torch.bfloat16, torch.float32)


def _layer_pair(recipe):
    """The same Linear converted twice by torchao (emulate=True); the second marked for the fast path."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 48))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    ours, theirs = (convert_to_float8_training(copy.deepcopy(base), config=config) for _ in range(2))
    assert mark_converted_layers(ours, torch.float32) == 2
    return ours, theirs


@pytest.mark.parametrize("recipe", ("tensorwise", "rowwise"))
@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
def test_forward_and_backward_match_torchao_emulation(recipe, compiled):
    """Same FP8 casts, same exact products: the fast path and torchao's emulation agree to
    rounding, forward and every gradient, in eager mode and under torch.compile (both compiled:
    inductor's fused casts differ from eager ones by a bf16 ulp, for torchao's path as for this)."""
    ours, theirs = _layer_pair(recipe)
    assert all(
        type(m.linear_mm_config.output).lowbit_compute_dtype is not None
        for m in ours.modules()
        if isinstance(m, Float8Linear)
    )
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    results = []
    for model in (ours, theirs):
        run = torch.compile(model) if compiled else model
        inp = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(inp)
        out.float().square().mean().backward()
        results.append((out.float(), inp.grad, [p.grad for p in model.parameters()]))
    (out_a, gin_a, grads_a), (out_b, gin_b, grads_b) = results
    torch.testing.assert_close(out_a, out_b, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(gin_a, gin_b, rtol=5e-2, atol=1e-4)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=5e-2, atol=1e-4)


def test_fast_emulation_is_the_default_and_torchao_stays_selectable():
    def first_fp8(acc):
        model = acc.prepare(mlp())
        return next(m for m in model.modules() if isinstance(m, Float8Linear))

    fast = first_fp8(Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()]))
    plain = first_fp8(Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(emulation="torchao")]))
    # both are held to CUDA's shape rule; only the default multiplies the fp8 values itself
    assert type(fast.linear_mm_config.output).lowbit_compute_dtype in (torch.float32, torch.bfloat16)
    assert type(plain.linear_mm_config.output).lowbit_compute_dtype is None
    assert fast.config.emulate and plain.config.emulate


def test_trains_and_matches_torchao_emulation_over_many_steps():
    from lowbit.cli.self_test import train_steps

    x, y = regression_data(64)
    losses = {}
    for emulation in ("fast", "torchao"):
        acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(emulation=emulation)])
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        losses[emulation] = train_steps(acc, model, opt, x, y, 30)
    assert losses["fast"][-1] < 0.8 * losses["fast"][0]
    assert abs(losses["fast"][-1] - losses["torchao"][-1]) / losses["torchao"][-1] < 0.02, losses


@pytest.mark.parametrize("emulation", ["fast", "torchao"])
def test_under_a_profiler_each_fp8_gemm_is_one_named_range(emulation):
    """An emulated FP8 GEMM is a dozen small operations in a trace; each is grouped under one
    ``lowbit::fp8_gemm`` range (3 per converted Linear per step: forward, input and weight
    gradients), and nothing is recorded when no profiler runs."""
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(emulation=emulation)])
    model = acc.prepare(mlp(seed=0, width=64))
    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    x, _ = regression_data(32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        acc.backward(model(x).pow(2).mean())
    ranges = [e.name for e in prof.events() if e.name.startswith("lowbit::fp8_gemm")]
    assert converted >= 1 and ranges == ["lowbit::fp8_gemm (emulated)"] * (3 * converted)
