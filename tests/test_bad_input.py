"""Bad input gets a clear error at the call that caused it (issue: reliability)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from helpers import FakeBackend, manager_with, mlp

from lowbit import Accelerator

from lowbit.kernel.errors import ConfigError

from lowbit.run.settings import read_config_file, resolve_config, validate_config


def test_kwargs_handlers_must_be_a_list():
    from lowbit.utils import FP8RecipeKwargs

    with pytest.raises(ConfigError, match=r"kwargs_handlers must be a list.*kwargs_handlers=\[FP8RecipeKwargs\(\)\]"):
        Accelerator(kwargs_handlers=FP8RecipeKwargs(), plugin_manager=manager_with())


def test_unknown_dynamo_backend_is_refused_at_construction():
    with pytest.raises(
        ConfigError, match=r"dynamo_backend 'inductr' is not a torch.compile backend.*Did you mean 'inductor'"
    ):
        Accelerator(dynamo_backend="inductr", plugin_manager=manager_with())
    Accelerator(dynamo_backend="EAGER", plugin_manager=manager_with())  # Accelerate's upper-case names are fine


def test_inductor_on_cpu_without_a_compiler_is_refused_at_prepare(monkeypatch, tmp_path):
    """torch.compile's inductor builds C++ at the first forward; without a compiler lowbit says so
    at prepare (what was looked for, what to install, what runs without one), and loses nothing."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no c++, g++ or clang++
    monkeypatch.delenv("CXX", raising=False)
    model = mlp()
    accelerator = Accelerator(dynamo_backend="inductor", cpu=True, plugin_manager=manager_with())
    with pytest.raises(
        ConfigError,
        match=r"no C\+\+ compiler was found \(looked for c\+\+, g\+\+, clang\+\+ on PATH\)"
        r".*apt install g\+\+.*dynamo_backend='aot_eager'",
    ):
        accelerator.prepare(model)
    monkeypatch.setenv("CXX", "my-g++")
    with pytest.raises(ConfigError, match=r"looked for \$CXX=my-g\+\+ on PATH"):
        Accelerator(dynamo_backend="inductor", cpu=True, plugin_manager=manager_with()).prepare(mlp())
    Accelerator(dynamo_backend="aot_eager", cpu=True, plugin_manager=manager_with()).prepare(mlp())


def test_inductor_on_a_gpu_without_a_c_compiler_is_refused_before_triton_needs_one(monkeypatch, tmp_path):
    """On a GPU, Triton builds each kernel's launcher with a C compiler (gcc or clang, or $CC): a GPU
    image without one failed inside the first compiled call. The check held for the CPU only."""
    from lowbit.runtime.training.toolchain import check_compiler_for

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    advice = check_compiler_for("inductor", "cuda")
    assert advice and "Triton build each GPU kernel's launcher" in advice and "looked for gcc, clang" in advice
    assert "apt install gcc" in advice
    (tmp_path / "gcc").write_text("#!/bin/sh\n")
    (tmp_path / "gcc").chmod(0o755)
    assert check_compiler_for("inductor", "cuda") is None
    assert check_compiler_for("aot_eager", "cuda") is None


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes("mixed_precision: bf16\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0xe9 at offset 27\)"):
        read_config_file(path)


def test_config_file_over_the_size_limit_is_refused_before_parsing(tmp_path, monkeypatch):
    path = tmp_path / "huge.yaml"
    path.write_text("mixed_precision: bf16\n" + "# padding\n" * 120_000)
    parsed = []
    import yaml

    monkeypatch.setattr(yaml, "safe_load", lambda text: parsed.append(text))
    with pytest.raises(ConfigError, match=r"MiB.*over 1 MiB are refused"):
        read_config_file(path)
    assert parsed == []


def test_the_config_file_is_read_once_per_accelerator(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: bf16\n")
    import lowbit.run.settings as config

    reads = []
    real = config.read_config_file
    monkeypatch.setattr(config, "read_config_file", lambda p: reads.append(p) or real(p))
    acc = Accelerator(config_file=path, plugin_manager=manager_with())
    assert acc.mixed_precision == "bf16" and len(reads) == 1


def test_an_unknown_lowbit_env_var_is_a_warning_with_a_suggestion():
    with pytest.warns(
        UserWarning,
        match=r"LOWBIT_MIXED_PRECISON is read by neither lowbit nor an installed plugin.*Did you mean "
        r"'LOWBIT_MIXED_PRECISION'",
    ):
        resolve_config(environ={"LOWBIT_MIXED_PRECISON": "bf16"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_config(environ={"LOWBIT_MIXED_PRECISION": "bf16", "LOWBIT_FP8_BACKEND": "ao", "LOWBIT_PLUGINS": ""})


def test_a_model_prepared_again_comes_back_as_it_is_and_another_accelerator_prepares_it_once_more():
    acc = Accelerator(plugin_manager=manager_with())
    model = acc.prepare(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    again, prepared_optimizer = acc.prepare(model, optimizer)  # Accelerate's FSDP docs: model first, then both
    assert again is model and len(acc._run.prepared.models) == 1
    assert acc.prepare(prepared_optimizer) is prepared_optimizer
    # A second Trainer on the same model (TRL's SFT then DPO): prepared again, as Accelerate does.
    other = Accelerator(plugin_manager=manager_with())
    model_again, optimizer_again = other.prepare(model, prepared_optimizer)
    assert model_again is model and optimizer_again.optimizer is optimizer
    assert not hasattr(model.forward, "__wrapped__") or not hasattr(model.forward.__wrapped__, "__wrapped__")


def test_a_model_converted_by_one_run_is_refused_by_a_run_with_other_precision_settings():
    """Its fp8 layers would train in a format the second run did not ask for: refused, naming both."""
    fp8 = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(FakeBackend("fake", 100)))
    model = fp8.prepare(mlp())
    fp8.free_memory()
    with pytest.raises(ConfigError, match=r"(?s)prepared before by a run whose backend converted.*'fake'.*bf16"):
        Accelerator(mixed_precision="bf16", plugin_manager=manager_with()).prepare(model)
    fp8.prepare(model)  # the same settings: prepared again


def test_backward_on_fp8_without_a_prepared_model_is_an_error():
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(FakeBackend("fake", 100)))
    model = mlp()
    loss = model(torch.randn(4, 32)).sum()
    with pytest.raises(ConfigError, match="no model was prepared"):
        acc.backward(loss)


def test_fp8_key_of_a_backend_that_is_not_installed_says_to_install_its_plugin():
    """The core keeps no list of the plugins' keys: a key no installed backend reads is unknown,
    and the error says it may belong to a plugin that is not installed."""
    with pytest.raises(
        ConfigError, match=r"Unknown key 'pad_inner_dim' in fp8_config.*backend whose plugin is not installed"
    ):
        validate_config({"fp8_config": {"pad_inner_dim": "true"}}, fp8_specs={})
    with pytest.raises(ConfigError, match=r"Unknown key 'recipee'"):
        validate_config({"fp8_config": {"recipee": "rowwise"}}, fp8_specs={})


def test_launch_with_fp8_options_but_no_fp8_precision_is_an_error(tmp_path, capsys):
    from lowbit.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    assert main(["launch", "--fp8_backend", "te", str(script)]) == 2
    err = capsys.readouterr().err
    assert "LOWBIT_FP8_BACKEND" in err and "mixed_precision is 'no'" in err and "--mixed_precision fp8" in err


@pytest.mark.parametrize(
    "name, value, wanted",
    [
        ("LOWBIT_PREEMPTION_POLL_STEPS", "abc", "a whole number at least 1"),
        ("LOWBIT_PREEMPTION_POLL_STEPS", "0", "out of range: it takes a whole number at least 1"),
        ("LOWBIT_THROUGHPUT_EVERY", "abc", "a number at least 0"),
        ("LOWBIT_THROUGHPUT_EVERY", "-5", "out of range"),
        ("LOWBIT_ARRIVAL_TIMEOUT", "0", "more than 0"),
    ],
)
def test_a_bad_number_in_a_lowbit_variable_is_refused_at_the_start_naming_it(monkeypatch, name, value, wanted):
    """LOWBIT_PREEMPTION_POLL_STEPS=0 was a ZeroDivisionError on rank 1 mid-run, =abc a bare
    ValueError at import; LOWBIT_THROUGHPUT_EVERY=abc named nothing. Read when the Accelerator is
    made, refused with the variable, its value and the range it takes."""
    from lowbit.kernel.errors import ConfigError

    from lowbit.runtime.process_group import arrival_timeout

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"{name}={value!r}.*{wanted}.*unset it for the default"):
        arrival_timeout() if name == "LOWBIT_ARRIVAL_TIMEOUT" else Accelerator(cpu=True)


@pytest.mark.parametrize(
    "value, on", [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("no", False)]
)
def test_every_lowbit_switch_takes_the_same_truth_values(monkeypatch, value, on):
    """LOWBIT_SIMULATE_NCCL=true once left the simulation off with no word (only 1 counted)."""
    from lowbit.runtime.collective_device import asked_to_simulate
    from lowbit.runtime.observe.throughput import meter_is_on

    monkeypatch.setenv("LOWBIT_SIMULATE_NCCL", value)
    monkeypatch.setenv("LOWBIT_THROUGHPUT", value)
    assert asked_to_simulate() is on and meter_is_on() is on


def test_a_switch_with_another_value_is_an_error_naming_the_variable(monkeypatch):
    from lowbit.runtime.collective_device import asked_to_simulate

    monkeypatch.setenv("LOWBIT_SIMULATE_NCCL", "maybe")
    with pytest.raises(ConfigError, match=r"LOWBIT_SIMULATE_NCCL='maybe' is not a switch.*1/true/yes/on"):
        asked_to_simulate()


def test_accumulation_steps_below_one_are_refused_naming_where_they_came_from(monkeypatch):
    """Accelerate's GradientAccumulationPlugin(num_steps=0) became 1 silently (0 == False); an env
    var's bad value did not name the variable."""
    accelerate_utils = pytest.importorskip("accelerate.utils")
    with pytest.raises(ConfigError, match=r"GradientAccumulationPlugin\(num_steps=0\): .* at least 1"):
        Accelerator(cpu=True, gradient_accumulation_plugin=accelerate_utils.GradientAccumulationPlugin(num_steps=0))
    monkeypatch.setenv("LOWBIT_GRADIENT_ACCUMULATION_STEPS", "-3")
    with pytest.raises(ConfigError, match="environment variable LOWBIT_GRADIENT_ACCUMULATION_STEPS.*got -3"):
        Accelerator(cpu=True)


def test_an_error_in_a_backends_conversion_names_the_backend():
    """It reached the user as the backend's own error, naming neither the backend nor lowbit."""
    import sys
    import traceback

    from lowbit import hookimpl

    class Failing(FakeBackend):
        @hookimpl
        def convert_model(self, model, context):
            raise RuntimeError("shape (3, 5) is not supported")

    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(Failing("failing", 100)))
    with pytest.raises(RuntimeError, match=r"shape \(3, 5\)") as raised:
        acc.prepare(mlp())
    if sys.version_info >= (3, 11):  # exception notes
        shown = "".join(traceback.format_exception(raised.value))
        assert "lowbit: raised in convert_model of the low-precision backend 'failing'" in shown, shown


@pytest.mark.parametrize("steps", [0, -2, 1.5, "4"])
def test_an_accumulation_plugins_bad_count_is_named_as_written(steps):
    from lowbit.utils import GradientAccumulationPlugin

    written = re.escape(f"GradientAccumulationPlugin(num_steps={steps!r})")
    with pytest.raises(ConfigError, match=rf"{written}: the micro"):
        Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=steps))
