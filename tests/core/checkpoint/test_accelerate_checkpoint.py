"""A run moving from Accelerate to lowbit mid-training: ``load_state`` on a directory written by
Accelerate's own ``save_state`` (run for real, in its own process) restores weights, optimizer
state, scheduler, registered objects, the step counter and the RNGs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TESTS, Counter
from torch import nn

from lowbit import Accelerator

from lowbit.kernel.errors import CheckpointError

ACCELERATE_RUN = TESTS / "scripts" / "accelerate_save_state.py"


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_load_state_resumes_a_checkpoint_written_by_accelerate(tmp_path, weights, recwarn):
    pytest.importorskip("accelerate")
    proc = subprocess.run(
        [sys.executable, str(ACCELERATE_RUN), str(tmp_path), weights], capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / ("model.safetensors" if weights == "safetensors" else "pytorch_model.bin")).exists()
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)

    torch.manual_seed(123)  # a different start: everything must come from the checkpoint
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    accelerator = Accelerator(cpu=True)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.load_state(tmp_path / "ckpt")

    for key, value in reference["model"].items():
        assert torch.equal(model.state_dict()[key], value), key
    mine, theirs = optimizer.state_dict(), reference["optimizer"]
    for index, state in theirs["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(mine["state"][index][name]), torch.as_tensor(value)), (index, name)
    assert mine["param_groups"][0]["lr"] == theirs["param_groups"][0]["lr"]
    assert scheduler.state_dict() == reference["scheduler"]
    assert counter.n == reference["seen"] == 32
    assert torch.equal(torch.rand(3), reference["next_random"])  # the torch RNG continues where Accelerate's was
    notes = [str(w.message) for w in recwarn]
    assert any("skipped sampler.bin" in n for n in notes) or not (tmp_path / "ckpt" / "sampler.bin").exists(), notes


def test_a_pickled_object_in_an_accelerate_checkpoint_is_refused_by_name(tmp_path):
    """Accelerate's files are pickles; lowbit loads them without running code."""
    (tmp_path / "optimizer.bin").write_bytes(b"")  # marks the directory as Accelerate's
    torch.save({"0.weight": torch.zeros(4, 8), "0.bias": torch.zeros(4)}, tmp_path / "pytorch_model.bin")

    class Evil:
        def __reduce__(self):
            return (print, ("pickled code ran",))

    torch.save({"state": {}, "param_groups": [Evil()]}, tmp_path / "optimizer.bin")
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(
        nn.Sequential(nn.Linear(8, 4)), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    )
    with pytest.raises(CheckpointError, match=r"optimizer.bin \(optimizer state\) cannot be read safely"):
        accelerator.load_state(tmp_path)


def _prepared_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _snapshot(model, optimizer) -> tuple[dict, dict]:
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {"lr": optimizer.param_groups[0]["lr"], "state": len(optimizer.state_dict()["state"])},
    )


def _write_checkpoint(directory: Path, width: int = 16, optimizer_bytes: bytes | None = None) -> None:
    """Accelerate's layout: model.safetensors, optimizer.bin (written as Accelerate's torch.save does)."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    torch.save(optimizer.state_dict(), directory / "optimizer.bin")
    if optimizer_bytes is not None:
        (directory / "optimizer.bin").write_bytes(optimizer_bytes)


@pytest.mark.parametrize(
    "damage", ["truncated optimizer", "model of another width", "safetensors header too long", "truncated safetensors"]
)
def test_a_load_that_fails_changes_nothing_and_names_the_file(tmp_path, damage):
    """The weights were loaded before the optimizer file failed, and a model of another width had
    its fitting tensors copied before the error; a broken .safetensors gave a raw SafetensorError."""
    ckpt = tmp_path / "ckpt"
    _write_checkpoint(ckpt, width=32 if damage == "model of another width" else 16)
    if damage == "truncated optimizer":
        data = (ckpt / "optimizer.bin").read_bytes()
        (ckpt / "optimizer.bin").write_bytes(data[: len(data) // 2])
        message = r"optimizer.bin \(optimizer state\) cannot be read"
    elif damage == "model of another width":
        message = (
            r"model.safetensors does not fit this model: 0.weight is \(32, 8\) torch.float32 in the file and \(16, 8\)"
        )
    elif damage == "safetensors header too long":
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + data[8:])
        message = r"model.safetensors' cannot be read \(truncated or corrupted safetensors\)"
    else:
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(data[:-20])
        message = r"model.safetensors' cannot be read \(truncated or corrupted safetensors\)"
    accelerator, model, optimizer = _prepared_run()
    weights, opt_state = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=message):
        accelerator.load_state(ckpt)
    after, opt_after = _snapshot(model, optimizer)
    assert all(torch.equal(weights[k], after[k]) for k in weights) and opt_after == opt_state
