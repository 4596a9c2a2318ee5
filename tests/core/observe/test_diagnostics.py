"""`lowbit test`, accelerator.profile() and FP8 numerics telemetry."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from helpers import install_entry_points, install_plugin_module, mlp, regression_data, run_launch
from torch import nn

from lowbit import Accelerator

from lowbit.kernel.errors import ConfigError
from lowbit.kernel.telemetry import SaturationWarning, TelemetryRecorder, UnderflowWarning, cast_stats


def lowbit_test(*flags, env=None):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    return run_launch([sys.executable, "-m", "lowbit.cli.main", "test", *flags], env=full_env)


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_lowbit_test_passes_on_cpu(precision):
    if precision == "fp8":
        pytest.importorskip("lowbit_ao")
    proc = lowbit_test("--mixed_precision", precision)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for check in ("hardware detected", "backend chosen", "loss decreasing", "checkpoint round-trip"):
        assert f"PASS {check}" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("lowbit test: PASS")
    assert ("PASS FP8 layers converted" in proc.stdout) == (precision == "fp8")


@pytest.mark.multiprocess
def test_lowbit_test_runs_under_the_launcher_with_two_processes():
    pytest.importorskip("lowbit_ao")
    proc = lowbit_test("--cpu", "--num_processes", "2", "--mixed_precision", "fp8")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "PASS ranks agreeing" in proc.stdout and "2 process(es), strategy ddp" in proc.stdout


def test_lowbit_test_fails_naming_the_check_when_a_backend_is_unavailable():
    proc = lowbit_test("--mixed_precision", "fp8", "--fp8_backend", "te")
    assert proc.returncode != 0
    assert "FAIL backend chosen" in proc.stdout and "lowbit test: FAIL (backend chosen)" in proc.stdout


def test_lowbit_test_fails_when_the_backend_converts_no_layer(tmp_path):
    install_plugin_module(tmp_path, "lowbit_noop_fp8")
    install_entry_points(tmp_path, "lowbit-noop", "0.1", {"noop": "lowbit_noop_fp8"})
    proc = lowbit_test("--mixed_precision", "fp8", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0
    assert "FAIL FP8 layers converted: 0 of 4 Linear layers" in proc.stdout
    assert "lowbit test: FAIL (FP8 layers converted)" in proc.stdout


def test_profile_writes_a_trace_that_parses_and_a_summary(tmp_path):
    acc = Accelerator(mixed_precision="bf16")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    x, y = regression_data(32)
    with acc.profile(tmp_path) as prof:
        for _ in range(5):
            opt.zero_grad()
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            prof.step()
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in names or "aten::mm" in names
    summary = (tmp_path / "summary.txt").read_text()
    assert "self_cpu_time_total" in summary and "peak resident memory" in summary


@pytest.mark.parametrize("given_to", ["accelerator", "call"])
def test_profile_without_a_directory_behaves_as_accelerate(tmp_path, given_to):
    """Accelerate's form: the whole block is profiled (no schedule, no .step() needed), with the
    ProfileKwargs from kwargs_handlers or from the call; output_trace_dir gets a trace per rank."""
    from lowbit.utils import ProfileKwargs

    handler = ProfileKwargs(record_shapes=True, output_trace_dir=str(tmp_path / "traces"))
    acc = Accelerator(kwargs_handlers=[handler] if given_to == "accelerator" else [])
    model = acc.prepare(mlp())
    x, _ = regression_data(8)
    with acc.profile() if given_to == "accelerator" else acc.profile(handler) as prof:
        model(x)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=5)
    assert "aten::" in table
    trace = json.loads((tmp_path / "traces" / "trace_rank0.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])


def test_saturation_and_flush_fractions_match_a_hand_computation():
    # 1000 tiny values and one outlier: the outlier sets amax, so the scale is 448 / 1000 and
    # every tiny value (1e-3 * 0.448 = 4.5e-4) falls below half of e4m3's smallest subnormal
    # (2**-9 / 2 = 9.8e-4): all 1000 flush to zero. Nothing exceeds the range.
    x = torch.full((1001,), 1e-3)
    x[0] = 1000.0
    stats = cast_stats(x, torch.float8_e4m3fn, torch.tensor(448.0 / 1000.0)).read()
    assert stats.amax == 1000.0
    assert abs(stats.flushed - 1000 / 1001) < 1e-6
    assert abs(stats.saturated - 0.0) < 1e-6
    # With a scale taken from the tiny values instead (a stale, delayed scale), the outlier saturates.
    stale = cast_stats(x, torch.float8_e4m3fn, torch.tensor(448.0 / 1e-3)).read()
    assert abs(stale.saturated - 1 / 1001) < 1e-6 and stale.flushed == 0.0


def test_ao_telemetry_reports_the_layers_casts_with_torchaos_scale():
    pytest.importorskip("lowbit_ao")
    acc = Accelerator(mixed_precision="fp8")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    acc.enable_fp8_telemetry()
    x, y = regression_data(32)
    x[0, 0] = 500.0  # an outlier in the batch
    opt.zero_grad()
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    table = acc.fp8_stats()
    layers = {row.layer for row in table}
    assert layers == {"2", "4"}  # the FP8 layers (first and last Linear stay high precision)
    row = next(r for r in table if r.layer == "2")
    assert set(row.tensors) == {"input", "weight", "grad_output"}
    weight = acc.unwrap_model(model)[2].weight.detach()
    # weight stats were sampled before the optimizer step: compare against the dynamic-scale rule
    assert row.tensors["weight"].scale == pytest.approx(448.0 / row.tensors["weight"].amax, rel=1e-6)
    assert row.tensors["weight"].amax == pytest.approx(weight.abs().max().item(), rel=0.05)
    assert "grad_output" in str(table) and "saturated" in str(table)


def test_saturation_warning_fires_past_the_threshold():
    recorder = TelemetryRecorder(saturation_warning=0.0001)
    x = torch.ones(100)
    with pytest.warns(SaturationWarning, match=r"layer1's input exceeds the format's range"):
        recorder.record("layer1", "input", x, torch.float8_e4m3fn, torch.tensor(1000.0))
        recorder.next_step()  # the step's figures are read (and judged) when it ends


def test_underflow_is_said_like_saturation():
    """97% of a layer's input flushed to zero went unsaid while 0.1% saturation was a warning: one
    value of 1e6 sets the per-tensor scale, and the other values (1e-3) fall below E4M3's smallest
    subnormal after it."""
    import warnings

    x = torch.full((100,), 1e-3)
    x[0] = 1e6
    scale = torch.tensor(448.0 / 1e6)
    with pytest.warns(
        UnderflowWarning,
        match=r"FP8 underflow: 99.00% of layer1's input flushes to zero at step 0 "
        r"\(threshold 1.00%\)",
    ):
        recorder = TelemetryRecorder()
        recorder.record("layer1", "input", x, torch.float8_e4m3fn, scale)
        recorder.next_step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = TelemetryRecorder(underflow_warning=0.995)
        quiet.record("layer2", "input", x, torch.float8_e4m3fn, scale)
        quiet.next_step()


def test_telemetry_flags_a_non_finite_amax():
    recorder = TelemetryRecorder()
    x = torch.ones(100)
    x[3] = float("nan")
    with pytest.warns(SaturationWarning, match=r"layer1's grad_output holds NaN or inf at step 0"):
        recorder.record("layer1", "grad_output", x, torch.float8_e5m2, torch.tensor(1.0))
        recorder.next_step()


def test_telemetry_off_by_default_and_unsupported_backends_say_so():
    from helpers import FakeBackend, manager_with

    from lowbit.kernel.errors import UnsupportedCombinationError

    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(FakeBackend("plain", 100)))
    acc.prepare(mlp())
    with pytest.raises(ConfigError, match="enable_fp8_telemetry"):
        acc.fp8_stats()
    with pytest.raises(UnsupportedCombinationError, match="not supported by the 'plain' backend"):
        acc.enable_fp8_telemetry()


@pytest.mark.multiprocess
def test_profile_under_two_processes_writes_one_trace_per_rank(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "builtin"))  # test_distributed.py
    from test_distributed import launch

    launch(tmp_path, "profile")
    out = tmp_path / "profile" / "profile"
    for rank in (0, 1):
        assert json.loads((out / f"trace_rank{rank}.json").read_text())["traceEvents"]
    assert (out / "summary.txt").exists()  # written by the main process only, once


def test_telemetry_reads_the_device_once_per_sampled_step():
    """The figures of every layer and tensor stay on the device until the step ends, then one read."""
    pytest.importorskip("lowbit_ao")
    from torch.utils._python_dispatch import TorchDispatchMode

    acc = Accelerator(mixed_precision="fp8")
    model = mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    acc.enable_fp8_telemetry(every_n_steps=2)
    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(func)
            return func(*args, **(kwargs or {}))

    x, y = torch.randn(32, 32), torch.randn(32, 8)
    per_step = []
    for _ in range(4):
        reads.clear()
        with Reads():
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        per_step.append(len(reads))
    # the step's finite verdict (1) every step, and nothing per layer: the telemetry reads its figures
    # with one .tolist() at the step's end (it read 12 scalars per layer, each a host sync on a GPU)
    assert per_step == [1, 1, 1, 1], per_step
    assert acc.fp8_stats() and all(layer.step == 2 for layer in acc.fp8_stats())
