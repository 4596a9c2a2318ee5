"""The run's plan (lowbit.run.plan): decided once when the run is built, then never written."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lowbit import Accelerator

import lowbit.run.settings as settings


def prepared_run(**kwargs):
    acc = Accelerator(cpu=True, **kwargs)
    model = nn.Linear(4, 4)
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    return acc


def test_nothing_writes_the_plan_its_settings_or_its_context():
    plan = prepared_run(mixed_precision="bf16")._run.plan
    for field in dataclasses.fields(plan):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, field.name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config.gradient_accumulation_steps = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.context.batch_size = 4


def test_what_prepare_learns_reaches_the_hooks_and_leaves_the_plan_as_built():
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    plan = acc._run.plan
    built = dataclasses.asdict(plan.context)
    model = nn.Linear(4, 4)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(range(8), batch_size=2))
    assert acc._run.plan is plan and dataclasses.asdict(plan.context) == built
    assert plan.context.batch_size is None
    assert acc._run.context.batch_size == 2  # the context the hooks are handed from now on


def test_a_new_accumulation_count_makes_a_new_plan():
    acc = prepared_run(gradient_accumulation_steps=2)
    before = acc._run.plan
    acc.gradient_accumulation_steps = 3  # transformers' Trainer does this after making the Accelerator
    assert before.config.gradient_accumulation_steps == before.context.gradient_accumulation_steps == 2
    assert acc._run.plan.config.gradient_accumulation_steps == 3
    assert acc._run.context.gradient_accumulation_steps == 3 and acc._run.context.batch_size == 2
    assert acc.gradient_accumulation_steps == 3


def test_every_settings_layer_reads_one_snapshot_of_the_environment(monkeypatch):
    monkeypatch.setenv("LOWBIT_MIXED_PRECISION", "bf16")
    seen = []
    read_layers = settings.setting_layers

    def spy(explicit, environ, *args, **kwargs):
        seen.append(environ)
        return read_layers(explicit, environ, *args, **kwargs)

    monkeypatch.setattr(settings, "setting_layers", spy)
    from lowbit.run.plan import plan_run
    from lowbit.run.plugin_manager import make_plugin_manager
    from lowbit.run.training_run import RunRequest

    plan = plan_run(RunRequest(settings={}, front_precision="no"), make_plugin_manager())
    assert plan.mixed_precision == "bf16"  # the environment over the front's default
    assert len(seen) == 3  # use_cpu before the plugins, the precision over the front's, then every setting
    assert all(environ is seen[0] for environ in seen) and seen[0]["LOWBIT_MIXED_PRECISION"] == "bf16"
