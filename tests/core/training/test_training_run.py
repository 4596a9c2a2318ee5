"""lowbit.run.training_run: a run built from lowbit's settings alone, without Accelerate's
classes (what a second front would build), trains exactly as the Accelerator that builds one."""

from __future__ import annotations

import pytest
import torch
from helpers import mlp, regression_data

from lowbit import Accelerator

from lowbit.kernel.errors import ConfigError

from lowbit.run.training_run import RunRequest, TrainingRun


def _train(prepare, backward, steps: int = 3) -> list[float]:
    model = mlp(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = prepare(model, optimizer)
    x, y = regression_data(n=32)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_run_built_from_settings_alone_trains_as_the_accelerator(precision):
    run = TrainingRun(RunRequest({"mixed_precision": precision, "use_cpu": True}))
    assert run.mixed_precision == precision and run.backend is None and run.strategy is None
    alone = _train(run.prepare, run.precision.backward)
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    assert alone == _train(accelerator.prepare, accelerator.backward)
    assert "no low-precision backend in use" in run.explain_backend_choice()


def test_a_run_checks_its_settings_as_the_accelerator_does():
    with pytest.raises(
        ConfigError, match="'gradient_accumulation_steps' \\(from Accelerator arguments.*must be at least 1, got 0"
    ):
        TrainingRun(RunRequest({"gradient_accumulation_steps": 0}))
    with pytest.raises(ConfigError, match="not a torch.compile backend"):
        TrainingRun(RunRequest({"dynamo_backend": "inductr"}))
