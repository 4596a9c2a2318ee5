"""The CPU path refuses what a GPU refuses: torchao FP8 GEMMs held to CUDA's torch._scaled_mm shape rule.

On an H100, torch._scaled_mm refuses an inner dimension that is not a multiple of 16, and the
weight-gradient GEMM puts the token count there. These tests train with odd batch and sequence
sizes under every CPU path (lowbit's fast emulation, torchao's emulation, torch's CPU
_scaled_mm) and check that lowbit's default pads, as Accelerate does, and that padding turned
off fails here the way it would fail on the GPU.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("lowbit_ao")
pytest.importorskip("torchao.float8")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.utils import AORecipeKwargs  # noqa: E402

from lowbit_ao.gemm_rules import FP8GemmShapeError, check_scaled_mm_shapes  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::lowbit_ao.convert.EmulationNotice")

# (batch, sequence): 33, 33 and 35 tokens, none a multiple of 16.
ODD_TOKENS = [(3, 11), (1, 33), (5, 7)]
PATHS = [dict(emulation="fast"), dict(emulation="torchao"), dict(emulate=False)]


def cuda_scaled_mm_rule(original):
    """torch._scaled_mm held to its CUDA checks, written from aten/src/ATen/native/cuda/Blas.cpp
    (_scaled_mm_out_cuda): mat1.size(1) % 16, mat2.size(0) % 16 and mat2.size(1) % 16."""

    def checked(mat1, mat2, *args, **kwargs):
        if mat1.shape[1] % 16 or mat2.shape[0] % 16 or mat2.shape[1] % 16:
            raise RuntimeError(f"CUDA rule: ({tuple(mat1.shape)}) @ ({tuple(mat2.shape)}) not multiples of 16")
        return original(mat1, mat2, *args, **kwargs)

    return checked


class TokenModel(nn.Module):
    """A sequence model: (batch, seq, 32) -> (batch, seq, 8); the two middle Linears go FP8."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
        )

    def forward(self, x):
        return self.layers(x)


def train(acc: Accelerator, shapes, steps: int = 2) -> list[float]:
    model = TokenModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    losses = []
    for batch, seq in shapes:
        for _ in range(steps):
            x = torch.randn(batch, seq, 32)
            loss = model(x).pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("path", PATHS, ids=lambda p: next(f"{k}={v}" for k, v in p.items()))
def test_odd_token_counts_train_by_default_on_every_cpu_path(path, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", cuda_scaled_mm_rule(torch._scaled_mm))
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(**path)])
    losses = train(acc, ODD_TOKENS)
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert "padded to multiples of 16" in acc.fp8_report()


@pytest.mark.parametrize("path", PATHS, ids=lambda p: next(f"{k}={v}" for k, v in p.items()))
def test_padding_off_fails_on_cpu_as_it_would_on_a_gpu(path):
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(pad_inner_dim=False, **path)])
    with pytest.raises(FP8GemmShapeError, match=r"weight-gradient .*\(64x33\) @ \(33x64\).*token count"):
        train(acc, [(3, 11)])
    assert "padded" not in acc.fp8_report()


def test_padding_off_still_trains_token_counts_the_gpu_takes():
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(pad_inner_dim=False)])
    assert len(train(acc, [(2, 16), (4, 12)])) == 4


def test_padding_changes_no_result():
    """Zero padding adds nothing to a dot product: the same losses, padded or not."""
    shapes = [(2, 16), (3, 16)]
    padded = train(Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(emulation="torchao")]), shapes)
    plain = train(
        Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(emulation="torchao", pad_inner_dim=False)]),
        shapes,
    )
    assert padded == plain


def _fp8(shape, role):
    return types.SimpleNamespace(_data=torch.empty(shape), _gemm_input_role=types.SimpleNamespace(value=role))


@pytest.mark.parametrize(
    "a, b, pad, ok",
    [
        ((33, 64), (64, 64), False, True),  # rows (M) are free
        ((64, 33), (33, 64), False, False),  # inner dim 33
        ((64, 33), (33, 64), True, True),  # padded to 48
        ((64, 64), (64, 40), True, False),  # output columns 40: padding does not help
    ],
)
def test_the_rule_is_cudas(a, b, pad, ok):
    check = lambda: check_scaled_mm_shapes(_fp8(a, "grad_output"), _fp8(b, "input"), pad)  # noqa: E731
    if ok:
        check()
    else:
        with pytest.raises(FP8GemmShapeError, match="would fail on a CUDA GPU"):
            check()


def test_a_user_config_keeps_its_own_padding_unless_the_option_is_given():
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    for recipe, expected in (
        (AORecipeKwargs(config=Float8LinearConfig()), False),
        (AORecipeKwargs(config=Float8LinearConfig(), pad_inner_dim=True), True),
    ):
        acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])
        model = acc.prepare(TokenModel())
        layer = next(m for m in model.modules() if isinstance(m, Float8Linear))
        assert layer.config.pad_inner_dim is expected
