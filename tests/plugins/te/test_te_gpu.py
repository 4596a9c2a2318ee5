"""lowbit-te on a real GPU with the real Transformer Engine: ``pytest -m gpu tests/plugins/te``.

Skipped without a CUDA sm_89+ GPU or without TE; a TE that is installed but does not import
fails (see ``helpers.needs_fp8_gpu_with``). The 2-process tests also need two GPUs. These have
not run in this repository's CI (it has no GPU); ``bench/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TiedLM, launch_argv, needs_fp8_gpu_with, run_launch, train_on_gpu
from torch import nn

from lowbit import Accelerator
from lowbit.utils import TERecipeKwargs

from lowbit_te.runtime import TERunState

gpu_te = needs_fp8_gpu_with("transformer_engine.pytorch", "Transformer Engine")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
WORKER = Path(__file__).with_name("te_gpu_worker.py")
# recipe -> TE's own check for it on this GPU
RECIPE_CHECKS = {
    "delayed": "is_fp8_available",
    "current": "is_fp8_available",
    "mxfp8": "is_mxfp8_available",
    "block": "is_fp8_block_scaling_available",
    "nvfp4": "is_nvfp4_available",
}


class Block(nn.Module):
    """Every layer kind lowbit-te converts, with FP8-friendly sizes."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(256)
        self.up = nn.Linear(256, 512)
        self.rms = nn.RMSNorm(512)
        self.down = nn.Linear(512, 256)

    def forward(self, x):
        return self.down(self.rms(nn.functional.gelu(self.up(self.norm(x)))))


def train(precision: str, steps: int = 20, **recipe):
    torch.manual_seed(0)
    return train_on_gpu(Block(), precision, [TERecipeKwargs(**recipe)], (128, 256), steps)


def te_verdict(name: str) -> tuple[bool, str]:
    import transformer_engine.pytorch as te

    ok, why = getattr(te, name)(return_reason=True)
    return bool(ok), str(why)


@gpu_te
def test_real_te_modules_replace_linear_and_norms_and_train_close_to_bf16():
    import transformer_engine.pytorch as te

    accelerator, model, losses = train("fp8")
    assert accelerator.fp8_backend == "te"
    kinds = {type(m) for m in model.modules()}
    assert {te.Linear, te.LayerNorm, te.RMSNorm} <= kinds, kinds
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0], losses
    _, _, bf16 = train("bf16")
    assert abs(losses[0] - bf16[0]) / bf16[0] < 0.02  # same weights, one forward: FP8 rounding only
    assert abs(losses[-1] - bf16[-1]) / bf16[-1] < 0.05, (losses[-1], bf16[-1])


@gpu_te
@pytest.mark.parametrize("scaling", sorted(RECIPE_CHECKS))
def test_every_recipe_this_gpu_supports_trains(scaling):
    ok, why = te_verdict(RECIPE_CHECKS[scaling])
    if not ok:
        pytest.skip(f"Transformer Engine says {scaling} scaling cannot run on this GPU: {why}")
    accelerator, model, losses = train("fp4" if scaling == "nvfp4" else "fp8", recipe=scaling)
    assert (
        type(accelerator._run.context.plugin_state(TERunState).recipe).__name__
        == {
            "delayed": "DelayedScaling",
            "current": "Float8CurrentScaling",
            "mxfp8": "MXFP8BlockScaling",
            "block": "Float8BlockScaling",
            "nvfp4": "NVFP4BlockScaling",
        }[scaling]
    )
    assert losses[-1] < 0.7 * losses[0], losses


@gpu_te
def test_save_state_and_load_state_keep_the_fp8_metadata(tmp_path):
    """With the real TE (2.20 refuses pickled extra state; 2.9 would run it): nothing pickled is
    written, an eval pass before the save loses nothing, and a never-run model resumes exactly."""
    accelerator, model, _ = train("fp8", steps=5)
    histories = {
        n: m.fp8_meta["scaling_fwd"].amax_history.clone()
        for n, m in model.named_modules()
        if hasattr(getattr(m, "fp8_meta", {}).get("scaling_fwd"), "amax_history")
    }
    assert histories and all(v.numel() == 0 for k, v in model.state_dict().items() if k.endswith("_extra_state"))
    model.eval()
    with torch.no_grad():
        model(torch.randn(16, 256, device="cuda"))
    model.train()
    accelerator.save_state(tmp_path / "state")
    x = torch.randn(16, 256, device="cuda")
    with torch.no_grad():
        before = model(x)
    fresh_acc, fresh, _ = train("fp8", steps=0)
    fresh_acc.load_state(tmp_path / "state")
    for name, history in histories.items():
        assert torch.equal(fresh.get_submodule(name).fp8_meta["scaling_fwd"].amax_history, history), name
    with torch.no_grad():
        after = fresh(x)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@gpu_te
def test_the_conformance_kit_passes_on_real_te(tmp_path):
    from lowbit.conformance import run_conformance

    report = run_conformance("te", heavy_modules=("transformer_engine",), tmp_path=tmp_path)
    assert report["converted"]


def _launch(tmp_path: Path, *flags: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = launch_argv("--num_processes", "2", *flags, str(WORKER), str(tmp_path))
    proc = run_launch(cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@gpu_te
@two_gpus
def test_ddp_reduces_amax_across_ranks(tmp_path):
    """Each rank sees different data; with the data-parallel group as TE's amax reduction group,
    the FP8 scaling state is the same on both ranks after a step, and so are the weights."""
    ranks = _launch(tmp_path, "--multi_gpu")
    assert ranks[0]["strategy"] == "ddp" and ranks[0]["fp8_backend"] == "te"
    assert ranks[0]["amax"] == ranks[1]["amax"] and ranks[0]["weights_sha"] == ranks[1]["weights_sha"]
    assert ranks[0]["losses"][-1] < 0.7 * ranks[0]["losses"][0]


@gpu_te
@two_gpus
def test_fsdp2_trains_with_te(tmp_path):
    ranks = _launch(tmp_path, "--use_fsdp")
    assert ranks[0]["strategy"] == "fsdp" and ranks[0]["fp8_backend"] == "te"
    assert ranks[0]["weights_sha"] == ranks[1]["weights_sha"]
    assert ranks[0]["losses"][-1] < 0.7 * ranks[0]["losses"][0]


def test_gpu_worker_is_valid_python():
    """The worker above only runs on GPUs; at least it must compile everywhere."""
    subprocess.run([sys.executable, "-m", "py_compile", str(WORKER)], check=True)


@gpu_te
def test_odd_token_counts_and_a_tied_head_train_on_real_te():
    """33 tokens (TE's FP8 GEMM takes multiples of 8) are padded; a head tied to the embedding stays tied."""
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs()])
    model = TiedLM(vocab=256, width=256).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert model.head.weight is model.embed.weight
    ids = torch.randint(0, 256, (3, 11), device="cuda")
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss) and model.head.weight is model.embed.weight
