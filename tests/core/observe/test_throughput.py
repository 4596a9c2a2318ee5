"""The throughput meter: tokens, samples, FLOPs (counted on the first training step), MFU, data
wait and peak memory of a run, with no code in the script; on the progress line and in trackers."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lowbit import Accelerator
from lowbit.observe.gpu_specs import gpu_peak
from lowbit.observe.throughput import ThroughputMeter, batch_counts
from lowbit.tracking import GeneralTracker


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


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    return LlamaForCausalLM(config)


def _batches(n=6, batch=4, seq=32):
    data = [torch.randint(0, 128, (seq,)) for _ in range(n * batch)]
    return DataLoader(data, batch_size=batch, collate_fn=lambda b: {"input_ids": torch.stack(b), "labels": torch.stack(b)})


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
    model = _tiny_llama()
    params = sum(p.numel() for p in model.parameters())
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), _batches())
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        loss.backward() if own_backward else accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
    figures = accelerator.throughput
    assert figures["throughput/tokens_per_s"] > 0 and figures["throughput/samples_per_s"] > 0
    assert figures["throughput/tokens_per_s"] == pytest.approx(32 * figures["throughput/samples_per_s"])
    assert figures["throughput/peak_memory_mb"] > 0 and no_counting_left()
    if own_backward:  # a backward lowbit did not run is not counted: no FLOPs rather than half of them
        assert "throughput/mfu" not in figures
        return
    # training FLOPs per token, counted by torch: about 6 per parameter (forward 2, backward 4), plus attention
    per_token = accelerator._throughput.flops_per_unit
    assert 4 * params < per_token < 10 * params, (per_token, params)
    assert 0 < figures["throughput/mfu"] < 1.5
    assert 0 <= figures["throughput/data_wait_share"] <= 1
    assert any("throughput/mfu" in logged for logged in recorder.logged)  # the trackers got them too
    said = capsys.readouterr().out
    assert "tokens/s" in said and "MFU" in said and "step 6" in said


def test_the_meter_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LOWBIT_THROUGHPUT", "0")
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(torch.nn.Linear(3, 1), None, DataLoader(torch.randn(8, 3), batch_size=4))
    for batch in loader:
        accelerator.backward(model(batch).sum())
    assert accelerator.throughput == {}


def no_counting_left() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is None


def test_a_forward_without_backward_or_with_an_error_leaves_no_counting_behind():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4))  # a training forward whose backward never comes
    assert no_counting_left()
    with pytest.raises(RuntimeError):
        accelerator.prepare(torch.nn.Linear(4, 4))(torch.randn(2, 5))  # a forward that fails
    assert no_counting_left()
    compiled = torch.compile(lambda x: x * 2, fullgraph=True)  # what a leftover counting mode broke
    assert compiled(torch.ones(1)).item() == 2


def test_gemms_the_counter_cannot_see_leave_flops_out_instead_of_a_wrong_mfu(recwarn):
    """Transformer Engine's GEMMs are its own kernels, not aten ops: a count far below the
    parameters' forward FLOPs means the GEMMs were missed."""
    meter = ThroughputMeter(torch.device("cpu"), 1, "fp8", is_main=False)
    meter.parameters = 10**6  # a model whose GEMMs ran outside torch's counter
    meter.on_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, 0.0)
    for part in ("forward", "backward"):
        with meter.count(part):
            torch.randn(4, 4).relu()  # only elementwise work is seen
    meter.on_step()
    assert "throughput/tflops_per_device" not in meter.latest and "throughput/tokens_per_s" in meter.latest
    assert any("does not see" in str(w.message) for w in recwarn)
