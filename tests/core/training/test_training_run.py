"""lowbit.run.training_run: a run built from lowbit's settings alone, without Accelerate's
classes (what a second front would build), trains exactly as the Accelerator that builds one."""

from __future__ import annotations

import pytest
import torch
from helpers import mlp, regression_data

from lowbit import Accelerator

from lowbit.kernel.errors import ConfigError

from lowbit.run.training_run import RunRequest, TrainingRun


def _train(front, steps: int = 4) -> list[float]:
    """Train with ``front``'s loop verbs (a TrainingRun, or an Accelerator): accumulate, backward,
    clip_grad_norm_ (on the micro-batch that steps, as fp16 requires) and autocast, as a script does."""
    model = mlp(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = front.prepare(model, optimizer)
    x, y = regression_data(n=32)
    losses = []
    for _ in range(steps):
        with front.accumulate(model):
            output = model(x)
            with front.autocast():
                loss = torch.nn.functional.mse_loss(output.float(), y)
            front.backward(loss)
            if front.sync_gradients:
                front.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_a_run_built_from_settings_alone_trains_with_its_own_verbs_as_the_accelerator(precision):
    """A second front needs no Accelerate class: the run has the loop's verbs (fp16's loss scaling,
    accumulation over 2 micro-batches, clipping), and trains exactly as the Accelerator."""
    settings = {"mixed_precision": precision, "use_cpu": True, "gradient_accumulation_steps": 2}
    run = TrainingRun(RunRequest(settings))
    assert run.plan.mixed_precision == precision and run.plan.backend is None and run.plan.strategy is None
    alone = _train(run)
    accelerator = Accelerator(mixed_precision=precision, cpu=True, gradient_accumulation_steps=2)
    assert alone == _train(accelerator)
    assert "no low-precision backend in use" in run.explain_backend_choice()


def test_a_run_checks_its_settings_as_the_accelerator_does():
    with pytest.raises(
        ConfigError, match="'gradient_accumulation_steps' \\(from arguments in the code.*must be at least 1, got 0"
    ):
        TrainingRun(RunRequest({"gradient_accumulation_steps": 0}))
    with pytest.raises(ConfigError, match="not a torch.compile backend"):
        TrainingRun(RunRequest({"dynamo_backend": "inductr"}))
