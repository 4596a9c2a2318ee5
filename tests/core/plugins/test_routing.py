"""Every routed hook is called on the chosen plugins only, in the documented order."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch
from helpers import TESTS, FakeBackend, manager_with, mlp
from torch import nn

from lowbit import Accelerator, hookimpl

from lowbit.kernel.errors import PluginError
from lowbit.kernel.types import StrategyDescription, StrategyIntegration


class RecordingBackend(FakeBackend):
    """An FP8 backend implementing every FP8 hook, recording each call."""

    @hookimpl
    def check_compatibility(self, context):
        self.calls.append("check_compatibility")

    @hookimpl
    def after_optimizer_step(self, model, optimizer, context):
        self.calls.append("after_optimizer_step")
        return lambda: self.calls.append("after-step work")

    @hookimpl
    def clip_grad_norm(self, parameters, max_norm, norm_type, context):
        self.calls.append("clip_grad_norm")
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    @hookimpl
    def strategy_integration(self, strategy, context):
        self.calls.append(f"strategy_integration:{strategy}")
        return StrategyIntegration(config={"marker": self.name})

    @hookimpl
    def export_state_dict(self, model, state_dict, context):
        self.calls.append("export_state_dict")
        return state_dict


class JointBackend(RecordingBackend):
    @hookimpl
    def prepare_model_and_optimizer(self, model, optimizer, context):
        self.calls.append("prepare_model_and_optimizer")
        return model, optimizer


class RecordingStrategy:
    """A distributed strategy (named like DeepSpeed, to be chosen by distributed_type=DEEPSPEED)."""

    def __init__(self):
        self.calls: list[str] = []
        self.saw_integration = None

    @hookimpl
    def describe_backend(self, hardware):
        return StrategyDescription("deepspeed", 20, True)

    @hookimpl
    def check_compatibility(self, context):
        self.calls.append("check_compatibility")

    @hookimpl
    def wrap_for_distribution(self, model, optimizer, context):
        self.calls.append("wrap_for_distribution")
        self.saw_integration = context.strategy_integration
        return model, optimizer

    @hookimpl
    def backward(self, loss, model, context):
        self.calls.append("backward")
        loss.backward()
        return True

    @hookimpl
    def full_state_dict(self, model, context):
        self.calls.append("full_state_dict")
        return model.state_dict()

    @hookimpl
    def save_checkpoint(self, directory, model, optimizer, context):
        self.calls.append("save_checkpoint")
        torch.save(model.state_dict(), f"{directory}/strategy.pt")
        return True

    @hookimpl
    def load_checkpoint(self, directory, model, optimizer, context):
        self.calls.append("load_checkpoint")
        model.load_state_dict(torch.load(f"{directory}/strategy.pt", weights_only=True))
        return True


def run_everything(acc, tmp_path):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 32)
    opt.zero_grad()
    acc.backward(nn.functional.mse_loss(model(x), torch.zeros(4, 8)))
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    acc.save_model(model, tmp_path / "model")
    acc.save_state(tmp_path / "state")
    acc.load_state(tmp_path / "state")


def test_every_routed_hook_reaches_the_chosen_plugins_only(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_DISTRIBUTED_TYPE", "DEEPSPEED")
    chosen, other, strategy = RecordingBackend("chosen", 300), RecordingBackend("other", 100), RecordingStrategy()
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(chosen, other, strategy))
    run_everything(acc, tmp_path)
    assert chosen.calls == [  # autocast_context and after_optimizer_step: once each, at prepare (they give
        # functions); the after-step work after the step, and again after load_state replaced the weights
        "check_compatibility",
        "convert_model",
        "wrap_optimizer",
        "strategy_integration:deepspeed",
        "autocast_context",
        "after_optimizer_step",
        "clip_grad_norm",
        "after-step work",
        "export_state_dict",
        "after-step work",
    ]
    assert strategy.calls == [
        "check_compatibility",
        "wrap_for_distribution",
        "backward",
        "full_state_dict",
        "save_checkpoint",
        "load_checkpoint",
    ]
    assert strategy.saw_integration.config == {"marker": "chosen"}
    assert other.calls == []


@pytest.mark.parametrize(
    "answer, config_or_error",
    [
        ({"config": {"marker": "dict"}}, {"marker": "dict"}),  # a dict with the record's field names is taken
        ({"marker": "dict"}, "strategy_integration returned keys ['marker'] that StrategyIntegration has no field for"),
    ],
)
def test_a_strategy_integration_dict_becomes_the_typed_record(monkeypatch, answer, config_or_error):
    monkeypatch.setenv("LOWBIT_DISTRIBUTED_TYPE", "DEEPSPEED")
    backend, strategy = RecordingBackend("chosen", 300), RecordingStrategy()
    backend.strategy_integration = hookimpl(lambda strategy, context: answer)
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(backend, strategy))
    model = mlp()
    if isinstance(config_or_error, str):
        with pytest.raises(PluginError, match=re.escape(config_or_error)):
            acc.prepare(model)
    else:
        acc.prepare(model)
        assert strategy.saw_integration == StrategyIntegration(config=config_or_error)


def test_joint_hook_replaces_convert_and_wrap(tmp_path):
    joint = JointBackend("joint", 300)
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(joint))
    model = mlp()
    acc.prepare(model, torch.optim.AdamW(model.parameters()))
    assert joint.calls[:2] == ["check_compatibility", "prepare_model_and_optimizer"]
    assert "convert_model" not in joint.calls and "wrap_optimizer" not in joint.calls


def test_launcher_hooks_add_flags_and_env(monkeypatch, capfd):
    from lowbit.cli import launch
    from lowbit.cli.main import main

    class LaunchPlugin:
        @hookimpl
        def add_launch_arguments(self, parser):
            parser.add_argument("--my_knob", default=None)

        @hookimpl
        def launch_environment(self, args):
            return {"MY_KNOB": args.my_knob} if args.my_knob else None

    monkeypatch.setattr(launch, "_plugin_manager", lambda: manager_with(LaunchPlugin()))
    show_env = TESTS / "scripts" / "show_env.py"
    assert main(["launch", "--my_knob", "7", str(show_env), "MY_KNOB"]) == 0
    assert json.loads(capfd.readouterr().out.strip().splitlines()[-1])["MY_KNOB"] == "7"


def test_autocast_context_of_the_precision_plugin_wraps_the_fp8_one():
    order = []

    class Outer(FakeBackend):
        @hookimpl
        def autocast_context(self, model, context):
            @contextlib.contextmanager
            def ctx():
                order.append(("fp8 enter", torch.is_autocast_enabled("cpu")))
                yield

            return ctx

    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(Outer("x", 100)))
    acc.prepare(nn.Linear(4, 4))(torch.randn(1, 4))
    assert order == [("fp8 enter", True)]  # bf16 autocast was already on when the FP8 context entered


def test_firstresult_only_where_the_first_answer_wins():
    """Routed hooks reach one plugin and have one answer; only hardware detection asks every plugin
    and takes the first answer (a third-party detector before the built-in one)."""
    import lowbit.kernel.hookspecs as specs

    marked = {
        name
        for name, spec in vars(specs).items()
        if callable(spec) and getattr(spec, "lowbit_spec", {}).get("firstresult")
    }
    assert marked == {"detect_hardware"}
