"""The throughput meter: tokens, samples, FLOPs (counted on the first training step), MFU, data
wait and peak memory of a run, with no code in the script; on the progress line and in trackers."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from torch.utils.data import DataLoader

from lowbit import Accelerator
from lowbit.tracking import GeneralTracker

from lowbit.runtime.observe.gpu_specs import gpu_peak
from lowbit.runtime.observe.throughput import batch_counts
from lowbit.runtime.precision import Precision


def test_batches_are_counted_from_their_shapes():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert batch_counts({"input_ids": ids, "labels": ids, "attention_mask": ids}) == (4, 64)
    assert batch_counts((torch.randn(8, 3), torch.randn(8, 1))) == (8, None)  # no tokens in a regression batch
    assert batch_counts([torch.zeros(2, 5, dtype=torch.int32), torch.randn(2)]) == (2, 10)


def test_gpus_are_matched_to_their_own_row():
    assert gpu_peak("NVIDIA H100 PCIe").tflops == 756.0 and gpu_peak("NVIDIA H100 80GB HBM3").tflops == 989.4
    assert gpu_peak("NVIDIA L4").name == "L4" and gpu_peak("NVIDIA L40S").name == "L40S"
    assert gpu_peak("NVIDIA GB200").name == "GB200" and gpu_peak("NVIDIA B200").name == "B200"
    assert gpu_peak("NVIDIA A100-SXM4-80GB").fp8_tflops is None and gpu_peak("Tesla T4") is None


def _batches(n=6, batch=4, seq=32):
    data = [torch.randint(0, 128, (seq,)) for _ in range(n * batch)]
    return DataLoader(
        data, batch_size=batch, collate_fn=lambda b: {"input_ids": torch.stack(b), "labels": torch.stack(b)}
    )


class _Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self, run_name: str = "", **kwargs):
        super().__init__()
        self.logged: list[dict] = []

    def log(self, values, step=None, **kwargs):
        self.logged.append(dict(values))


@pytest.mark.parametrize("own_backward", [False, True])
def test_a_training_loop_reports_tokens_flops_and_mfu_and_its_trackers_get_them(monkeypatch, capsys, own_backward):
    monkeypatch.setenv("LOWBIT_THROUGHPUT_EVERY", "0.000001")  # a progress line at every step
    recorder = _Recorder()
    accelerator = Accelerator(cpu=True, log_with=recorder)
    accelerator.init_trackers("run")
    model = tiny_llama()  # grouped-query attention (4 query heads, 2 key/value heads)
    gemm_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), _batches())
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        loss.backward() if own_backward else accelerator.backward(loss)  # counted either way: nothing in the step
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
    figures = accelerator.throughput
    assert figures["throughput/tokens_per_s"] > 0 and figures["throughput/samples_per_s"] > 0
    assert figures["throughput/tokens_per_s"] == pytest.approx(32 * figures["throughput/samples_per_s"])
    assert figures["throughput/peak_memory_mb"] > 0
    # 6 FLOPs per Linear weight and token (forward 2, backward 4), plus attention's (counted on CPU too)
    per_token = accelerator._run.throughput.flops_per_unit
    assert 6 * gemm_params < per_token < 10 * gemm_params, (per_token, gemm_params)
    assert accelerator._run.throughput.counted_as == "model(**batch)"
    assert 0 < figures["throughput/mfu"] < 1.5
    assert 0 <= figures["throughput/data_wait_share"] <= 1
    assert any("throughput/mfu" in logged for logged in recorder.logged)  # the trackers got them too
    said = capsys.readouterr().out
    assert "tokens/s" in said and "MFU" in said and "step 6" in said


def test_the_count_is_exact_for_a_known_model():
    """A two-Linear MLP fed as model(batch[0]): 3 x 2 x tokens x (32x64 + 64x8) FLOPs, per sample."""
    accelerator = Accelerator(cpu=True)
    data = [(torch.randn(32), torch.randn(8)) for _ in range(8)]
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), DataLoader(data, batch_size=4)
    )
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    meter = accelerator._run.throughput
    assert meter.counted_as == "model(batch[0])"
    assert meter.flops_per_unit == 3 * 2 * (32 * 64 + 64 * 8)


def test_the_count_traces_a_copy_even_when_the_forward_was_replaced_on_the_instance():
    """TRL's SFTTrainer sets ``model.forward`` to a function closing over the original bound
    forward: the count must trace the copy's own layers, never the user's model."""
    import types

    from lowbit.runtime.observe.fp8_payoff import meta_copy, trace_work

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    original = model.forward
    calls = []

    def patched(self, x):
        calls.append(1)
        return original(x)

    model.forward = types.MethodType(patched, model)
    work = trace_work(meta_copy(model), (torch.zeros(4, 32, device="meta"),), {})
    assert [layer.name for layer in work.linears] == ["0", "2"] and not calls


def test_the_meter_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LOWBIT_THROUGHPUT", "0")
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(
        torch.nn.Linear(3, 1), None, DataLoader(torch.randn(8, 3), batch_size=4)
    )
    for batch in loader:
        accelerator.backward(model(batch).sum())
    assert accelerator.throughput == {}


class _SeesModes(torch.nn.Module):
    """Records whether any torch function or dispatch mode is active inside its forward."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.modes: list[bool] = []

    def forward(self, x):
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        self.modes.append(_get_current_dispatch_mode() is not None or bool(_get_current_function_mode_stack()))
        return self.linear(x)


def test_the_meter_runs_nothing_inside_the_users_forward():
    accelerator = Accelerator(cpu=True)
    model = _SeesModes()
    prepared, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(torch.randn(12, 4), batch_size=4)
    )
    for batch in loader:
        accelerator.backward(prepared(batch).sum())
        optimizer.step()
    # three forwards, none under a mode (the meter traced a meta copy, between steps)
    assert model.modes == [False, False, False]
    assert accelerator._run.throughput.flops_per_unit == 3 * 2 * 16


def test_a_count_that_fails_leaves_flops_out_with_one_note_and_never_breaks_the_step(monkeypatch, recwarn):
    import lowbit.runtime.observe.fp8_payoff as payoff

    def refuses(*args, **kwargs):
        raise AssertionError("a FLOP formula that does not take this shape")

    monkeypatch.setattr(payoff, "trace_work", refuses)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(torch.randn(12, 4), batch_size=4)
    )
    for batch in loader:
        accelerator.backward(model(batch).sum())
        optimizer.step()
    assert (
        "throughput/tflops_per_device" not in accelerator.throughput
        and "throughput/samples_per_s" in accelerator.throughput
    )
    notes = [str(w.message) for w in recwarn if "FLOPs were not counted" in str(w.message)]
    assert len(notes) == 1 and "model(batch)" in notes[0] and "AssertionError" in notes[0]


def test_fp8_gemm_share_counts_the_layers_the_backend_converted():
    pytest.importorskip("torchao")
    accelerator = Accelerator(mixed_precision="fp8", cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(torch.randn(64, 64), batch_size=16)
    )
    for batch in loader:
        accelerator.backward(model(batch).float().pow(2).mean())
        optimizer.step()
    converted = [m for m in accelerator.unwrap_model(model).modules() if type(m).__name__ == "Float8Linear"]
    assert 0 < len(converted) < 3  # the first and last Linear stay in bf16 by default
    assert accelerator._run.throughput.fp8_gemm_share == pytest.approx(len(converted) / 3)


def test_under_model_parallelism_the_count_is_per_device_and_tokens_per_data_parallel_batch():
    """Tensor parallel over 2 of 4 processes: each device does half a batch's GEMMs, and the 4
    processes read 2 different batches (tokens/s counts those, not 4)."""
    from lowbit.runtime.observe.throughput import ThroughputMeter

    def metered(data_parallel: int, model_parallel: int) -> ThroughputMeter:
        meter = ThroughputMeter(
            torch.device("cpu"),
            data_parallel,
            Precision.for_run("bf16", torch.device("cpu")),
            is_main=False,
            model_parallel=model_parallel,
        )
        meter.copy_structure(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)))
        batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long), "x": torch.randn(4, 16, 32)}
        meter.on_batch(batch, 0.0)
        meter.on_step()
        meter.on_batch(batch, 0.0)  # counted here, at the batch after the first step
        meter.on_step()
        return meter

    whole, split = metered(4, 1), metered(2, 2)
    assert whole.counted_as == "model(batch['x'])"
    assert whole.flops_per_unit == 3 * 2 * 16 * (32 * 64 + 64 * 8) * 4 / 64  # per token of the 4 x 16 batch
    assert split.flops_per_unit == whole.flops_per_unit / 2
    assert split.latest["throughput/tokens_per_s"] == pytest.approx(
        split.latest["throughput/tokens_per_s_per_device"] * 2
    )


# ---------------------------------------------------------------- the meter never changes a run


class _Stochastic(torch.nn.Module):
    """Draws from every global stream in its forward: dropout (torch's CPU generator), a layer drop
    by torch.rand, and Python's and NumPy's random modules."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.dropout = torch.nn.Dropout(0.3)

    def forward(self, x):
        import random

        import numpy

        for layer in self.layers:
            if self.training and random.random() < 0.2:  # layer drop
                continue
            keep = (torch.rand(x.shape[0], 1) > 0.1).to(x.device)  # stochastic depth per sample, drawn on the CPU
            x = self.dropout(torch.relu(layer(x))) * keep * (1 + 0.01 * float(numpy.random.rand()))
        return x


def _losses(meter_on: bool, monkeypatch) -> list[float]:
    import random

    import numpy

    monkeypatch.setenv("LOWBIT_THROUGHPUT", "1" if meter_on else "0")
    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    accelerator = Accelerator(cpu=True)
    model = _Stochastic()
    data = DataLoader(torch.randn(48, 16), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    losses = []
    for batch in loader:
        loss = model(batch).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert (accelerator._run.throughput is not None and accelerator._run.throughput.flops_per_unit) or not meter_on
    return losses


def test_the_count_leaves_every_random_stream_as_it_found_it(monkeypatch):
    """The count's forward draws too (dropout, layer drop): with the meter on, a stochastic model
    trained differently from step 2 on. Now the run is the same, bit for bit."""
    assert _losses(True, monkeypatch) == _losses(False, monkeypatch)


def test_the_count_runs_no_hook_of_the_users_and_copies_no_tensor_for_real():
    """A hook on the user's model (a logger, a counter, one that calls .cpu()) ran during the count,
    with fake values; a plain tensor attribute (not a parameter or buffer) was copied for real."""
    from lowbit.runtime.observe.fp8_payoff import meta_copy

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model.table = torch.ones(4096, 4096)  # 64 MB, a plain attribute
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.detach().cpu().sum().item()))
    model[1].register_forward_pre_hook(lambda module, args: seen.append("pre"))
    copy = meta_copy(model)
    assert copy.table.device.type == "meta" and copy[0].weight.device.type == "meta"
    assert not copy[0]._forward_hooks and not copy[1]._forward_pre_hooks and model[0]._forward_hooks
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(torch.randn(12, 8), batch_size=4)
    )
    for batch in loader:
        accelerator.backward(model(batch).sum())
        optimizer.step()
    assert len(seen) == 6  # three forwards, two hooks each: none during the count
    assert accelerator._run.throughput.flops_per_unit == 3 * 2 * (8 * 8 + 8 * 2)


def test_torchs_own_hooks_stay_in_the_copy():
    """weight_norm computes its weight in a forward pre-hook: part of the module's computation."""
    from lowbit.runtime.observe.fp8_payoff import meta_copy, trace_work

    model = torch.nn.utils.weight_norm(torch.nn.Linear(8, 4))
    work = trace_work(meta_copy(model), (torch.zeros(2, 8, device="meta"),), {})
    assert [(layer.in_features, layer.out_features) for layer in work.linears] == [(8, 4)]


class _SharedBlock(torch.nn.Module):
    """ALBERT-style: one block applied three times per forward."""

    def __init__(self):
        super().__init__()
        self.block = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for _ in range(3):
            x = torch.relu(self.block(x))
        return self.head(x)


class _ItemShape(torch.nn.Module):
    """Uses a tensor's value as a shape: how many rows to keep."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        keep = int((x[:, 0] > -100).sum().item())
        return self.linear(x[:keep])


def _counted(model, batches=3):
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), DataLoader(torch.randn(4 * batches, 16), batch_size=4)
    )
    for batch in loader:
        accelerator.backward(model(batch).sum())
        optimizer.step()
        optimizer.zero_grad()
    return accelerator


def test_a_block_applied_several_times_is_counted_each_time():
    assert _counted(_SharedBlock())._run.throughput.flops_per_unit == 3 * 2 * (3 * 16 * 16 + 16 * 4)


def test_a_forward_sized_by_a_host_read_value_is_not_counted_but_said(recwarn):
    """``.item()`` as a shape has no value on meta: the count took it as 1 (1/64 of the work here)."""
    accelerator = _counted(_ItemShape())
    assert (
        "throughput/tflops_per_device" not in accelerator.throughput
        and "throughput/samples_per_s" in accelerator.throughput
    )
    notes = [str(w.message) for w in recwarn if "FLOPs were not counted" in str(w.message)]
    assert len(notes) == 1 and ".item()" in notes[0]


def test_grouped_gemms_are_counted_and_a_custom_op_leaves_the_figure_out():
    """MoE experts run as one grouped GEMM (torch._grouped_mm): its work counts. A library's custom
    op (flash-attn's, Transformer Engine's) has work the tracer cannot see: refused, not zero."""
    from lowbit.runtime.observe.fp8_payoff import UncountableForward, trace_work

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 32, 16, dtype=torch.bfloat16))

        def forward(self, x):
            offsets = torch.tensor([16, 32, 48, 64], dtype=torch.int32, device=x.device)
            return torch._grouped_mm(x, self.weight, offs=offsets)

    x = torch.zeros(64, 32, dtype=torch.bfloat16, device="meta")
    assert trace_work(Experts(), (x,), {}).other_gemm_flops == 2 * 64 * 32 * 16

    @torch.library.custom_op("lowbit_test::fused_thing", mutates_args=())
    def fused_thing(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @fused_thing.register_fake
    def _(x):
        return torch.empty_like(x)

    class UsesCustomOp(torch.nn.Module):
        def forward(self, x):
            return fused_thing(x)

    with pytest.raises(UncountableForward, match="lowbit_test::fused_thing"):
        trace_work(UsesCustomOp(), (torch.zeros(4, 8, device="meta"),), {})


def test_on_a_gpu_the_step_time_is_the_devices_read_without_a_sync(monkeypatch):
    """The host clock measures when the CPU queued a step: with nothing syncing (on_nonfinite_loss=
    "continue", a fused fp16 optimizer, DeepSpeed) it runs ahead of the GPU. The meter times steps
    by events recorded at each step's end, read once the GPU finished them (query(): no sync). A
    stand-in event plays the GPU: 50 ms a step, the last step not finished yet."""
    from lowbit.runtime.observe.throughput import ThroughputMeter

    class Event:
        made: list = []

        def __init__(self, enable_timing=False):
            self.at, self.done = None, True
            Event.made.append(self)

        def record(self):
            self.at = 0.05 * len(Event.made)

        def query(self):
            return self.done

        def elapsed_time(self, end):
            assert self.query() and end.query(), "read before the GPU finished it: a sync"
            return (end.at - self.at) * 1000

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    meter = ThroughputMeter(
        torch.device("cuda", 0), 1, Precision.for_run("bf16", torch.device("cuda", 0)), is_main=False
    )
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long)}
    for _ in range(4):
        meter.on_batch(batch, 0.0)
        meter.on_step()
    Event.made[-1].done = False  # the newest step is still running on the GPU
    assert meter.latest["throughput/step_s"] == pytest.approx(0.05)
    assert meter.latest["throughput/tokens_per_s"] == pytest.approx(64 / 0.05)


def test_a_loop_that_feeds_tensors_itself_counts_its_tokens_with_set_batch_tokens(recwarn):
    """No prepared dataloader (examples/char_gpt.py, Ray Data's iterators): set_batch_tokens each step
    gives tokens/s, and the meter's 'no batch' note is not said."""
    from torch import nn

    from lowbit import Accelerator

    acc = Accelerator(cpu=True)
    model, optimizer = acc.prepare(nn.Linear(8, 8), torch.optim.SGD(nn.Linear(8, 8).parameters(), lr=0.1))
    for _ in range(3):
        acc.set_batch_tokens(128)
        acc.backward(model(torch.randn(4, 8)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    figures = acc.throughput
    assert figures["throughput/tokens_per_s"] == pytest.approx(128 / figures["throughput/step_s"], rel=1e-6)
    assert not [w for w in recwarn if "no batch came through" in str(w.message)]


def test_a_model_holding_a_torch_generator_is_named_in_the_meters_note(recwarn):
    """The note read ``SystemError: <method '__setstate__' ...>``: it says what the model holds."""

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)
            self.noise = torch.Generator().manual_seed(0)

        def forward(self, x):
            return self.layer(x) + torch.rand(x.shape, generator=self.noise)

    accelerator = Accelerator(cpu=True)
    model = Noisy()
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(torch.randn(12, 4), batch_size=4)
    )
    for batch in loader:
        accelerator.backward(model(batch).sum())
        optimizer.step()
    notes = [str(w.message) for w in recwarn if "FLOPs were not counted" in str(w.message)]
    assert len(notes) == 1 and "the model holds a torch.Generator (noise)" in notes[0], notes
    assert "SystemError" not in notes[0]


def test_mfu_above_100_percent_is_never_given_and_the_best_rate_becomes_the_peak(monkeypatch, tmp_path, recwarn):
    """A 2-core CPU's peak was one square matmul measured once (on a busy machine, cached for
    good): Trainer's line read "MFU 467.0%". A step faster than the peak gives no MFU, says why
    once, and its rate is the cached peak from then on; a measurement keeps the best rate seen."""
    from lowbit.runtime.observe import throughput
    from lowbit.runtime.observe.gpu_specs import DevicePeak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    meter = throughput.ThroughputMeter(torch.device("cpu"), 1, Precision("no", torch.device("cpu")), is_main=True)
    meter._peak = DevicePeak("a busy CPU", 1e-9, None, "measured here")
    meter.flops_per_unit = 1e9
    meter._last = (1.0, {"samples": 4, "tokens": 0, "wait": 0.0})
    figures = meter.latest
    assert "throughput/tflops_per_device" in figures and "throughput/mfu" not in figures
    assert "no MFU" in meter.progress_line()
    meter.latest  # noqa: B018 - said once
    notes = [str(w.message) for w in recwarn if "MFU is left out" in str(w.message)]
    assert len(notes) == 1 and "above a busy CPU's" in notes[0]
    cached = throughput.raise_cpu_peak(torch.float32, 0.0)
    assert cached == pytest.approx(4e9 / 1e12)  # the rate seen became the peak
    assert throughput.cpu_peak(torch.float32).tflops >= cached  # a new measurement never lowers it


def test_the_counts_forward_prints_nothing_the_run_never_computed(capsys):
    """A print in the forward showed ``act max 1.0000``, a value of the meta copy, not of the run."""

    class Chatty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, x):
            out = self.layer(x)
            print(f"act on {out.device.type}")
            return out

    accelerator = Accelerator(cpu=True)
    model = Chatty()
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(torch.randn(12, 4), batch_size=4)
    )
    for batch in loader:
        accelerator.backward(model(batch).sum())
        optimizer.step()
    printed = capsys.readouterr().out.split()
    assert "meta" not in printed and printed.count("cpu") == 3  # the run's three forwards only
    assert "throughput/tflops_per_device" in accelerator.throughput  # and the count still ran


def test_measuring_the_cpu_peak_draws_nothing_from_the_runs_random_streams(tmp_path):
    """It is measured at each run now (the best rate kept): its random matrices must not move
    torch's global RNG, or dropout would draw differently than under Accelerate."""
    from lowbit.runtime.observe import throughput

    before = torch.get_rng_state()
    throughput.cpu_peak(torch.float32, tmp_path / "peak.json")
    assert torch.equal(before, torch.get_rng_state())


def test_a_frozen_layer_counts_two_gemms_and_a_frozen_fp8_base_counts_in_the_fp8_share():
    """A LoRA-style model: the middle Linear frozen. Its step does no weight-gradient GEMM (2 of 3
    passes), and stored in FP8 (lowbit-ao's frozen base) its GEMMs are FP8."""
    pytest.importorskip("torchao")
    accelerator = Accelerator(mixed_precision="fp8", cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model[1].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(trainable, lr=0.1), DataLoader(torch.randn(64, 64), batch_size=16)
    )
    for batch in loader:
        accelerator.backward(model(batch).float().pow(2).mean())
        optimizer.step()
    meter = accelerator._run.throughput
    per_layer = 2 * 64 * 64  # FLOPs per token of one 64x64 GEMM
    assert meter.flops_per_unit == pytest.approx(per_layer * (3 + 2 + 3))
    assert meter.fp8_gemm_share == pytest.approx(2 / 8)  # the frozen FP8 base; the first and last stay bf16
