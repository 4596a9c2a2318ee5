"""MXFP8 and NVFP4 in lowbit-ao: the quantized values against independent references (bit for
bit), the GEMM shape rules a GPU would enforce, training a tiny Llama, save/load, telemetry."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lowbit_ao")

import torch  # noqa: E402
from helpers import mlp, regression_data, tiny_llama  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch import nn  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.utils import AORecipeKwargs  # noqa: E402

from lowbit.kernel.errors import UnsupportedCombinationError  # noqa: E402

from lowbit_ao import nvfp4  # noqa: E402
from lowbit_ao.block_formats import BlockScaled  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import format_references as ref  # noqa: E402


def _mx_test_rows(seed: int) -> torch.Tensor:
    """Rows with a wide dynamic range, exact ties for E4M3, zeros and a zero block."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(6, 64, generator=g) * torch.logspace(-6, 6, 6).unsqueeze(1)
    rows[0, :32] = 0.0
    rows[1, 5] = 2.0**-3 * (1 + 1 / 16)  # halfway between two E4M3 values of the block's scale
    return rows


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_values_and_scales_match_the_ocp_spec_bit_for_bit(rounding):
    """torchao's MX cast (what lowbit-ao's mxfp8 recipe runs) against the OCP MX v1.0 reference."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    rows = _mx_test_rows(0)
    mode = ScaleCalculationMode.FLOOR if rounding == "floor" else ScaleCalculationMode.RCEIL
    mx = MXTensor.to_mx(rows, torch.float8_e4m3fn, 32, mode, KernelPreference.EMULATED)
    exponents = mx.scale.view(torch.uint8).to(torch.int32) - 127
    for i, row in enumerate(rows.tolist()):
        want_exponents, want_elements = ref.mxfp8_quantize(row, rounding)
        assert exponents[i].tolist() == want_exponents, f"row {i}: E8M0 scales differ"
        assert mx.qdata[i].float().tolist() == want_elements, f"row {i}: E4M3 elements differ"


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_nvfp4_values_and_scales_match_nvidias_format_bit_for_bit(two_d):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g) * torch.logspace(-3, 3, 32).unsqueeze(1)
    x[3, :16] = 0.0
    x[4, 7] = 1e-12  # a value far below its block's resolution: flushes to zero
    values, scales, tensor_scale = nvfp4.quantize(x, two_d=two_d)
    want_values, want_scales, want_tensor_scale = ref.nvfp4_quantize(x.numpy(), two_d=two_d)
    assert np.float32(tensor_scale.item()) == want_tensor_scale
    assert np.array_equal(scales.float().numpy(), want_scales)
    assert np.array_equal(values.numpy(), want_values)
    assert set(np.unique(np.abs(want_values)).tolist()) <= {v for _, v in ref.E2M1}


def test_nvfp4_dequantized_error_is_within_the_formats_resolution():
    x = torch.randn(16, 64)
    back = nvfp4.fake_quantize(x)
    # E2M1's widest step is 2 units (4 to 6), so an element is off by at most 1 unit, the block's
    # decode scale: amax / 6, times up to 1 + 2^-4 where its E4M3 rounding went up.
    block_amax = x.abs().reshape(16, 4, 16).amax(-1, keepdim=True).expand(16, 4, 16).reshape(16, 64)
    error = (back - x).abs() / (block_amax / 6)
    assert error.max() <= 1 + 2**-4 and error.max() > 0.5


def test_stochastic_rounding_is_unbiased_and_stays_on_neighbours():
    torch.manual_seed(0)
    x = torch.full((20000,), 2.4)  # between E2M1's 2 and 3
    rounded = nvfp4.round_to_e2m1(x, stochastic=True)
    assert set(rounded.unique().tolist()) == {2.0, 3.0}
    assert abs(rounded.mean().item() - 2.4) < 0.02
    assert nvfp4.round_to_e2m1(torch.tensor([2.5, 3.5, 0.25, 0.75]), stochastic=False).tolist() == [2.0, 4.0, 0.0, 1.0]


def test_random_hadamard_cancels_in_the_weight_gradient():
    h = nvfp4.hadamard_16(nvfp4.random_signs(3))
    torch.testing.assert_close(h @ h.t(), torch.eye(16), atol=1e-6, rtol=0)
    a, b = torch.randn(32, 8, dtype=torch.float64), torch.randn(32, 5, dtype=torch.float64)
    rotated = nvfp4._along_tokens(a, h.double()) @ nvfp4._along_tokens(b, h.double()).t()
    torch.testing.assert_close(rotated, a.t() @ b)


# ------------------------------------------------------------------ prepare and train


def block_accelerator(recipe: str | None = None, precision: str = "fp8", **options):
    handler = AORecipeKwargs(recipe=recipe, **options) if recipe else AORecipeKwargs(**options)
    return Accelerator(mixed_precision=precision, kwargs_handlers=[handler])


class Odd(nn.Module):
    """A Linear whose dims MXFP8's 32-element blocks cannot take, between two that they can."""

    def __init__(self):
        super().__init__()
        self.first, self.a, self.odd, self.b, self.last = (
            nn.Linear(32, 64),
            nn.Linear(64, 64),
            nn.Linear(64, 48),
            nn.Linear(48, 64),
            nn.Linear(64, 8),
        )

    def forward(self, x):
        return self.last(self.b(self.odd(self.a(self.first(x)))))


def test_mxfp8_layers_follow_the_block_rule_and_the_report_names_the_format():
    acc = block_accelerator("mxfp8")
    model = acc.prepare(Odd())
    kinds = {name: isinstance(m, BlockScaled) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {"first": False, "a": True, "odd": False, "b": False, "last": False}
    report = acc.fp8_report()
    assert report.startswith("fp8 (ao, mxfp8, emulated): 1 of 5 Linear layers"), report
    assert "odd (dims 64x48 not divisible by 32 (mxfp8's block))" in report


def test_nvfp4_is_fp4_and_keeps_the_last_layers_in_bf16():
    acc = block_accelerator(precision="fp4", keep_first_last_high_precision=False, fp4_last_layers_bf16=0.5)
    model = acc.prepare(mlp(width=64))
    assert acc.fp8_options.recipe == "nvfp4"
    converted = [n for n, m in model.named_modules() if isinstance(m, BlockScaled)]
    assert converted == ["0", "2"]  # the last 2 of 4 stay in bf16
    assert "4 (in the last 50% of Linears, kept in bf16 (fp4_last_layers_bf16))" in acc.fp8_report()
    assert acc.fp8_report().startswith("fp4 (ao, nvfp4, emulated): 2 of 4")


@pytest.mark.parametrize("recipe, precision", [("mxfp8", "fp8"), ("nvfp4", "fp4")])
def test_odd_token_counts_are_padded_and_rows_are_unchanged(recipe, precision):
    """The weight-gradient GEMM scales the tokens in blocks: 3 x 11 tokens would be refused by
    torchao's MX cast (on any device); lowbit pads them, and the forward rows are those of the
    same tokens in a full batch (each row is scaled on its own)."""
    torch.manual_seed(0)
    acc = block_accelerator(recipe, precision, keep_first_last_high_precision=False, nvfp4_stochastic_rounding=False)
    layer = acc.prepare(nn.Sequential(nn.Linear(64, 64)))
    x = torch.randn(3, 11, 64, requires_grad=True)
    out = layer(x)
    assert out.shape == (3, 11, 64)
    full = layer(torch.cat([x.detach().reshape(33, 64), torch.randn(31, 64)]))
    torch.testing.assert_close(out.reshape(33, 64), full[:33], atol=0, rtol=0)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(layer[0].weight.grad).all()


def test_torchaos_mx_cast_refuses_what_lowbit_pads():
    """Without the padding the CPU refuses what the GPU refuses: the rule lowbit pads for is real."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    layer = MXFP8Linear(64, 64, kernel_preference=KernelPreference.EMULATED)
    with pytest.raises(AssertionError, match="divisible by block_size 32"):
        layer(torch.randn(33, 64)).sum().backward()


def test_float8_only_options_with_a_block_recipe_are_refused():
    with pytest.raises(
        UnsupportedCombinationError, match="enable_fsdp_float8_all_gather=True belongs to torchao's float8"
    ):
        block_accelerator("mxfp8", enable_fsdp_float8_all_gather=True).prepare(mlp())


def _train_tiny_llama(precision: str, handlers: list, steps: int = 40) -> tuple[float, Accelerator, nn.Module]:
    pytest.importorskip("transformers")
    model = tiny_llama(vocab_size=96, max_position_embeddings=64)
    acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = acc.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    # A learnable stream: each next token is the previous plus one (mod 96), from random starts.
    starts = torch.randint(0, 96, (steps, 4, 1), generator=g)
    losses = []
    for step in range(steps):
        ids = (starts[step] + torch.arange(32)) % 96
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return sum(losses[-5:]) / 5, acc, model


def test_a_tiny_llama_trains_in_mxfp8_and_fp4_close_to_fp32():
    """The gap to fp32 stays within what ``bench/formats.py`` reports for these formats (its
    table in the README: a few hundredths of a nat after a few hundred steps)."""
    reference, _, _ = _train_tiny_llama("no", [])
    mx, acc_mx, _ = _train_tiny_llama("fp8", [AORecipeKwargs(recipe="mxfp8")])
    fp4, acc_fp4, _ = _train_tiny_llama("fp4", [AORecipeKwargs()])
    assert acc_mx.fp8_report().startswith("fp8 (ao, mxfp8, emulated): 13 of 15 Linear layers")
    assert acc_fp4.fp8_report().startswith("fp4 (ao, nvfp4, emulated): ")
    first_loss = torch.log(torch.tensor(96.0)).item()
    assert reference < 0.5 * first_loss
    print(f"final loss: fp32 {reference:.4f}, mxfp8 {mx:.4f}, nvfp4 {fp4:.4f}")
    assert abs(mx - reference) < 0.1 * reference, (mx, reference)
    assert abs(fp4 - reference) < 0.25 * reference, (fp4, reference)


def test_save_model_of_a_block_model_loads_into_the_plain_model(tmp_path):
    acc = block_accelerator("mxfp8")
    model = acc.prepare(mlp())
    x, y = regression_data(64)
    nn.functional.mse_loss(model(x), y).backward()
    path = acc.save_model(model, tmp_path)
    plain = mlp(seed=5)
    plain.load_state_dict(load_file(path))
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert type(plain[2]) is nn.Linear


def test_save_and_load_state_resume_a_block_model(tmp_path):
    def run(steps):
        torch.manual_seed(0)
        acc = block_accelerator(precision="fp4")
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        x, y = regression_data(64)
        for _ in range(steps):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        return acc, model, opt

    acc, model, _ = run(3)
    acc.save_state(tmp_path / "ckpt")
    acc2, model2, opt2 = run(0)
    acc2.load_state(tmp_path / "ckpt")
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert isinstance(model2[2], BlockScaled)


def test_telemetry_counts_blocks_whose_scale_underflows():
    acc = block_accelerator(precision="fp4", keep_first_last_high_precision=False, fp4_last_layers_bf16=0.0)
    model = acc.prepare(nn.Sequential(nn.Linear(32, 32)))
    acc.enable_fp8_telemetry(model)
    x = torch.randn(16, 32)
    x[:, :16] *= 1e-12  # half the blocks sit ~12 decades below the tensor's amax: their E4M3 scale underflows
    model(x).sum().backward()
    stats = acc.fp8_stats()[0].tensors["input"]
    assert stats.blocks_underflow == pytest.approx(0.5) and stats.blocks_saturated == 0.0
    assert stats.flushed == pytest.approx(0.5)
    assert "blk under" in str(acc.fp8_stats())


def test_the_native_mxfp8_path_gets_the_operands_torchaos_sm100_kernels_take():
    """On a Blackwell GPU torchao's MXFP8 casts assert contiguous bf16 inputs with both dims in
    32-blocks (torchao 0.18 ``prototype/mx_formats/kernels.py``: ``triton_to_mxfp8_dim0`` and
    ``mxfp8_quantize_cuda``). Here the native path runs on the CPU with those asserts in place of
    the kernels, for a GPT-2 Conv1D (weight stored transposed), an odd token count and a
    non-contiguous, fp32 input outside autocast."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    acc = block_accelerator("mxfp8", keep_first_last_high_precision=False)
    model = acc.prepare(nn.Sequential(Conv1D(96, 64)))
    layer = model[0]
    assert isinstance(layer, BlockScaled)

    def kernel_rules(x, weight):
        for operand in (x.reshape(-1, x.shape[-1]), weight):
            assert operand.is_contiguous(), "`x` must be contiguous"
            assert operand.dtype == torch.bfloat16, "the cast takes bf16"
            assert operand.shape[0] % 32 == 0 and operand.shape[1] % 32 == 0, "rows and cols must be multiples of 32"
        return x.float() @ weight.float().t()

    layer._lowbit_block_native, layer._lowbit_block_gemm = True, kernel_rules
    x = torch.randn(64, 11, 3).transpose(0, 2)  # (3, 11, 64), not contiguous: 33 tokens
    out = layer(x)  # through the module: its hooks pad the tokens
    assert out.shape == (3, 11, 96) and out.dtype == torch.float32


# ------------------------------------------------------------------ native MXFP8 only where its kernels are


def _blackwell(capability=(10, 0)):
    from lowbit.kernel.types import HardwareInfo

    return HardwareInfo("cpu", "stand-in NVIDIA B200 (tensors on CPU)", 1, capability, (12, 9))


def test_mxfp8_kernels_are_checked_not_assumed_from_the_compute_capability(monkeypatch, tmp_path):
    """torchao defines its MXFP8 cast op on any sm_100+ GPU, but its kernel comes from _C_mxfp8 (built
    for sm_100a) and the dim-0 cast from triton: each missing piece is named, read without importing."""
    import importlib.util

    from lowbit_ao import native_kernels

    real_find_spec = importlib.util.find_spec
    with_triton = lambda name, *a: object() if name == "triton" else real_find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", with_triton)
    assert native_kernels.mxfp8_kernels_problem(_blackwell()) == ""  # this torchao wheel carries _C_mxfp8
    assert native_kernels.mxfp8_kernels_problem(_blackwell((9, 0))) == ""  # below sm_100: emulated anyway
    assert "built for sm_100a" in native_kernels.mxfp8_kernels_problem(_blackwell((12, 0)))
    monkeypatch.setattr(native_kernels, "_torchao_folder", lambda: tmp_path)  # torchao's py3-none-any wheel
    assert "no _C_mxfp8 extension" in native_kernels.mxfp8_kernels_problem(_blackwell())
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    if real_find_spec("triton") is None:
        assert "triton is not installed" in native_kernels.mxfp8_kernels_problem(_blackwell())


def test_without_its_kernels_mxfp8_is_emulated_on_blackwell_and_lowbit_env_says_so(monkeypatch):
    from lowbit.kernel.recipe_names import recipe_status

    import lowbit_ao

    monkeypatch.setattr(lowbit_ao, "mxfp8_kernels_problem", lambda hardware: "triton is not installed")
    assert recipe_status(lowbit_ao.describe_backend(_blackwell()), "mxfp8", _blackwell()) == "emulated"
    monkeypatch.setattr(lowbit_ao, "mxfp8_kernels_problem", lambda hardware: "")
    assert recipe_status(lowbit_ao.describe_backend(_blackwell()), "mxfp8", _blackwell()) == "native"


def test_a_native_mxfp8_run_whose_op_has_no_kernel_falls_back_to_the_emulated_kernels(monkeypatch, recwarn):
    """Planned native (sm_100, triton and the extension file found), but torchao::mxfp8_quantize has no
    CUDA kernel once torchao is imported (here: no CUDA at all): the run trains on the emulated
    kernels and says why, instead of failing in the first GEMM."""
    from helpers import HardwareDetector, said

    from lowbit.run.plugin_manager import make_plugin_manager

    import lowbit_ao
    from lowbit_ao import native_kernels

    for owner in (lowbit_ao, native_kernels):  # what can be read without torchao: all there
        monkeypatch.setattr(owner, "mxfp8_kernels_problem", lambda hardware: "")
    manager = make_plugin_manager(extra_plugins=[HardwareDetector(_blackwell())])
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager, kwargs_handlers=[AORecipeKwargs(recipe="mxfp8")])
    assert acc._run.context.recipe_runs == "native"  # the plan, from what could be read without torchao
    model = mlp(width=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    assert acc._run.context.recipe_runs == "emulated"
    assert "torchao::mxfp8_quantize has no CUDA kernel" in said(recwarn)
    x, y = regression_data(64)
    losses = []
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
