"""lowbit-ao on a real GPU: real FP8 GEMMs (torch._scaled_mm on CUDA), ``pytest -m gpu tests/plugins/ao``.

Skipped without a CUDA sm_89+ GPU; these have not run in this repository's CI (it has no GPU).
``bench/gpu_check.sh`` runs them on a GPU machine, offline.
"""

from __future__ import annotations

import pytest
import torch
from ao_helpers import launch_ddp_worker
from helpers import needs_fp8_gpu_with, train_on_gpu
from torch import nn

from lowbit.utils import AORecipeKwargs

gpu_ao = needs_fp8_gpu_with("torchao.float8", "torchao")
HIDDEN = 256


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.up, self.down, self.out = (
            nn.Linear(HIDDEN, HIDDEN),
            nn.Linear(HIDDEN, 4 * HIDDEN),
            nn.Linear(4 * HIDDEN, HIDDEN),
            nn.Linear(HIDDEN, HIDDEN),
        )

    def forward(self, x):
        return self.out(self.down(nn.functional.gelu(self.up(self.inp(x)))))


def train(precision: str, shape=(8, 64), steps: int = 20, **recipe):
    torch.manual_seed(0)
    return train_on_gpu(Block(), precision, [AORecipeKwargs(**recipe)], (*shape, HIDDEN), steps)


@gpu_ao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_fp8_gemms_train_close_to_bf16(recipe):
    from torchao.float8.float8_linear import Float8Linear

    accelerator, model, fp8 = train("fp8", recipe=recipe)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert accelerator.fp8_backend == "ao" and len(layers) == 2 and not layers[0].config.emulate  # real FP8 GEMMs
    _, _, bf16 = train("bf16")
    assert fp8[-1] < fp8[0] and abs(fp8[-1] - bf16[-1]) / bf16[-1] < 0.05


@gpu_ao
@pytest.mark.parametrize("shape", [(3, 11), (1, 33), (5, 7)])
def test_odd_token_counts_train_on_the_gpu(shape):
    """torch._scaled_mm on CUDA refuses an inner dim (the token count, in the weight-gradient
    GEMM) that is not a multiple of 16; lowbit pads by default."""
    _, _, losses = train("fp8", shape=shape, steps=3)
    assert all(torch.isfinite(torch.tensor(losses)))


@gpu_ao
def test_without_padding_the_gpu_refuses_what_the_cpu_check_refuses():
    with pytest.raises(RuntimeError, match="divisible by 16"):
        train("fp8", shape=(3, 11), steps=1, pad_inner_dim=False)


@gpu_ao
def test_save_state_load_state_and_save_model(tmp_path):
    from safetensors.torch import load_file

    accelerator, model, _ = train("fp8", steps=5)
    accelerator.save_state(tmp_path / "state")
    x = torch.randn(8, 64, HIDDEN, device="cuda")
    with torch.no_grad():
        before = model(x)
    fresh_acc, fresh, _ = train("fp8", steps=0)
    fresh_acc.load_state(tmp_path / "state")
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), before, rtol=0, atol=0)
    plain = Block()
    plain.load_state_dict(load_file(accelerator.save_model(model, tmp_path / "model")))


@gpu_ao
def test_ddp_on_one_gpu_under_lowbit_launch():
    """ddp_worker.py on the GPU; test_ao.py runs the same file on 2 CPU processes in CI."""
    result = launch_ddp_worker("--multi_gpu", "--num_processes", "1")
    assert result["device"] == "cuda" and result["strategy"] == "ddp" and result["losses"][-1] < result["losses"][0], (
        result
    )


@gpu_ao
def test_mxfp8_runs_torchaos_native_kernels_on_blackwell_and_trains():
    """sm_100+: torchao's MXFP8 kernels (no emulation); elsewhere the recipe runs emulated."""
    if torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("torchao's MXFP8 kernels are built for sm_100a (B200, GB200, B300); elsewhere mxfp8 runs emulated")
    from lowbit.kernel.types import HardwareInfo

    from lowbit_ao.native_kernels import mxfp8_kernels_problem

    missing = mxfp8_kernels_problem(HardwareInfo("cuda", "GPU", 1, torch.cuda.get_device_capability()))
    if missing:
        pytest.skip(missing)
    accelerator, model, losses = train("fp8", recipe="mxfp8")
    assert accelerator._run.context.recipe_runs == "native"
    assert accelerator.fp8_report().startswith("fp8 (ao, mxfp8): ")
    assert losses[-1] < 0.7 * losses[0], losses


@gpu_ao
def test_block_formats_train_emulated_on_any_fp8_gpu():
    """Below Blackwell, mxfp8 runs torchao's emulated kernels and nvfp4 lowbit-ao's emulation on
    the GPU, with the same rules (dims and tokens in blocks) as everywhere."""
    for precision, recipe in (("fp8", "mxfp8"), ("fp4", "nvfp4")):
        accelerator, model, losses = train(precision, shape=(3, 11), recipe=recipe)  # 33 tokens: padded
        assert accelerator.fp8_options.recipe == recipe
        assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)
        assert losses[-1] < losses[0], (recipe, losses)


@gpu_ao
@pytest.mark.parametrize("fmt", ["tensorwise", "blocks128"])
def test_a_frozen_fp8_base_runs_torchs_scaled_mm_and_agrees_with_the_emulation(fmt):
    """The frozen FP8 base's two GEMMs on the GPU (torch._scaled_mm: per tensor, or 1x128 x 128x128
    blocks, which needs sm_90 and CUDA 12.9+) against the CPU path's emulation of the same operands."""
    from lowbit_ao.frozen_base import FrozenGemms, quantized_base

    if fmt == "blocks128" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("blockwise _scaled_mm needs sm_90+")
    torch.manual_seed(0)
    weight = torch.randn(512, 256, device="cuda")
    results = {}
    for native in (True, False):
        layer = quantized_base(weight, None, fmt, FrozenGemms(native=native, compute_dtype=torch.bfloat16))
        x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
        with torch.autocast("cuda", torch.bfloat16):
            out = layer(x)
        out.float().pow(2).mean().backward()
        results[native] = (out.float().flatten(), x.grad.flatten())
    for ours, emulated in zip(results[True], results[False]):
        assert torch.nn.functional.cosine_similarity(ours, emulated, dim=0) >= 0.999


@gpu_ao
def test_fp8_lora_trains_on_the_gpu_with_frozen_fp8_bases():
    pytest.importorskip("peft")
    from lora_helpers import batch, lora_llama

    from lowbit import Accelerator

    from lowbit_ao.frozen_base import FrozenFP8Linear

    acc = Accelerator(mixed_precision="fp8")
    model = lora_llama().cuda()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    bases = [m for m in model.modules() if isinstance(m, FrozenFP8Linear)]
    assert len(bases) == 13 and all(m.gemms.native for m in bases)
    losses = []
    for i in range(20):
        ids = batch(i).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.9 * losses[0], losses
