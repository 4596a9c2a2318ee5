"""The NaN guard names where a non-finite step began (the step's batch replayed once, after the
check failed: nothing on healthy steps), and saves never write NaN/inf weights unseen."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lowbit import Accelerator

from lowbit.kernel.errors import CheckpointError


class _Overflow(nn.Module):
    """Finite input, inf output (divides by zero) when ``on``."""

    on = False

    def forward(self, x):
        return x / (x.abs().amax() * 0) if self.on else x


class _NaNBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class _BadBackward(nn.Module):
    """Passes its input on; its backward turns the finite gradient it gets into NaN when ``on``."""

    on = False

    def forward(self, x):
        return _NaNBackward.apply(x) if self.on else x


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.overflow = _Overflow()
        self.middle = nn.Linear(16, 16)
        self.bad_backward = _BadBackward()
        self.head = nn.Linear(16, 1)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        x = self.overflow(self.act(self.first(x)))
        x = self.bad_backward(self.dropout(self.middle(x)))
        return self.head(x)


def _run(poison, mixed_precision="no", steps=3):
    """Train ``steps`` steps; at step 2 ``poison(model)`` switches the fault on. Returns the
    warnings said, the RNG state just before and after the poisoned step, and the model."""
    acc = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = _Model()
    loader = DataLoader(torch.randn(4 * steps, 8), batch_size=4)
    prepared, optimizer, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    rng = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step, batch in enumerate(loader, start=1):
            if step == 2:
                poison(model)
            acc.backward(prepared(batch).float().pow(2).mean())
            if step == 2:
                rng["before"], grads = torch.get_rng_state(), [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            if step == 2:
                rng["after"] = torch.get_rng_state()
                rng["grads_kept"] = all(
                    torch.allclose(g, p.grad, equal_nan=True) for g, p in zip(grads, model.parameters())
                )
            optimizer.zero_grad()
            if step == 2:
                model.overflow.on = model.bad_backward.on = False
    messages = [str(w.message) for w in said if "NaN or inf" in str(w.message)]
    return messages, rng, model


def _on(part):
    def poison(model):
        getattr(model, part).on = True

    return poison


def test_a_nan_that_begins_in_a_forward_is_named_with_its_module():
    messages, rng, _ = _run(_on("overflow"))
    assert len(messages) == 1 and "optimizer step 2" in messages[0]
    assert "replayed: forward: overflow (_Overflow) made its finite input non-finite" in messages[0], messages
    assert torch.equal(rng["before"], rng["after"]) and rng["grads_kept"]  # the replay drew nothing, wrote no .grad


def test_a_nan_that_begins_in_a_backward_is_named_with_the_module_whose_backward_made_it():
    messages, _, _ = _run(_on("bad_backward"))
    assert "replayed: backward: in the input-gradient computation of bad_backward (_BadBackward)" in messages[0], (
        messages
    )


def test_a_layer_whose_weights_already_held_nan_is_said_so():
    def corrupt(model):
        with torch.no_grad():
            model.middle.weight[0, 0] = float("nan")

    messages, _, _ = _run(corrupt)
    assert "forward: middle (Linear) made its finite input non-finite; its weight already held NaN/inf" in messages[0]


def test_an_fp8_layer_that_overflows_is_named():
    pytest.importorskip("lowbit_ao")

    def corrupt(model):
        with torch.no_grad():
            model.middle.weight[0, 0] = float("inf")

    messages, _, model = _run(corrupt, mixed_precision="fp8")
    assert type(model.middle).__name__ == "Float8Linear"
    assert (
        "forward: middle (Float8Linear) made its finite input non-finite; its weight already held NaN/inf"
        in messages[0]
    )


def test_a_healthy_step_replays_nothing(monkeypatch):
    import lowbit.runtime.observe.nonfinite_origin as origin

    monkeypatch.setattr(origin, "find_nonfinite_origin", lambda *a: pytest.fail("replayed on a healthy step"))
    messages, _, _ = _run(lambda model: None)
    assert messages == []


def test_save_state_and_save_model_refuse_nonfinite_weights_unless_asked(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(nn.Linear(4, 4))
    acc.save_state(tmp_path / "good")
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    with pytest.raises(
        CheckpointError, match=r"save_state: 1 weight tensor\(s\) hold NaN or inf: weight\. Nothing was written"
    ):
        acc.save_state(tmp_path / "good")
    with pytest.raises(CheckpointError, match=r"save_model: 1 weight tensor\(s\) hold NaN or inf: weight"):
        acc.save_model(model, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    loaded = Accelerator(cpu=True)
    fresh = loaded.prepare(nn.Linear(4, 4))
    loaded.load_state(tmp_path / "good")  # the good checkpoint was left as it was
    assert torch.isfinite(fresh.weight).all()
    acc.save_state(tmp_path / "inspect", allow_nonfinite=True)
    acc.save_model(model, tmp_path / "model", allow_nonfinite=True)
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_batches_that_never_pass_a_prepared_loader_are_said_once_not_reported_wrong():
    """Ray Data's iterators (or a loop feeding tensors itself) hand batches past prepare(): the
    meter says once that it counts no samples, and a NaN step says its batch was not replayed."""
    acc = Accelerator(cpu=True)
    model = _Model()
    prepared, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = torch.randn(4, 4, 8)  # what ray.train's iter_torch_batches would hand the loop
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step, batch in enumerate(batches, start=1):
            model.overflow.on = step == 3
            acc.backward(prepared(batch).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    messages = [str(w.message) for w in said]
    no_batches = [m for m in messages if m.startswith("throughput: no batch came through")]
    assert len(no_batches) == 1 and "samples/s, tokens/s" in no_batches[0]
    nan = [m for m in messages if "NaN or inf" in m]
    assert len(nan) == 1 and "not replayed: no batch came through a prepared dataloader" in nan[0], messages
    assert "throughput/samples_per_s" not in acc.throughput


def test_a_nan_batch_folded_into_batchnorm_stats_is_said_at_the_skip_and_never_saved(tmp_path):
    """The forward folds a NaN input into BatchNorm's running stats before any check; the skip said
    "the weights are unchanged" and save_state wrote the NaN stats over the good checkpoint (it
    checked parameters only). The skipped step puts the stats back, and a save refuses NaN/inf
    buffers by name."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    batches = torch.randn(12, 4)
    batches[5] = float("nan")
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(batches, batch_size=4)
    )
    accelerator.save_state(tmp_path / "good")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for x in loader:
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    skips = [str(w.message) for w in said if "the step is skipped" in str(w.message)]
    assert len(skips) == 1 and "BatchNorm's running statistics are put back" in skips[0], skips
    assert "load the last checkpoint" not in skips[0]  # nothing left spoiled
    assert all(torch.isfinite(b).all() for b in model.buffers())
    accelerator.save_state(tmp_path / "good")  # the statistics are good again: saved
    with torch.no_grad():
        model[1].running_var.fill_(float("inf"))  # spoiled some other way: never saved
    with pytest.raises(CheckpointError, match=r"1\.running_var \(buffer\)"):
        accelerator.save_state(tmp_path / "good")
    assert (tmp_path / "good").exists()  # the good checkpoint stays


def test_a_nan_made_by_the_loss_function_outside_the_model_is_said_so():
    """It was blamed on "a nondeterministic kernel, or an earlier batch's": the model's forward and
    backward are finite on the batch, so the loss (or the loop) made it."""
    acc = Accelerator(cpu=True)
    model = _Model()
    loader = DataLoader(torch.randn(12, 8), batch_size=4)
    prepared, optimizer, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step, batch in enumerate(loader, start=1):
            output = prepared(batch).float()
            loss = (output - 1e6).log().mean() if step == 2 else output.pow(2).mean()  # log of negatives at step 2
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    messages = [str(w.message) for w in said if "NaN or inf" in str(w.message)]
    assert len(messages) == 1 and "the model's forward and backward are finite on this batch" in messages[0], messages
    assert "the loss computed outside the model" in messages[0]


def test_the_replay_leaves_buffers_and_module_generators_as_it_found_them():
    """The replay moved BatchNorm's running stats and num_batches_tracked again, and drew from a
    generator the model holds: the weights after the skipped step differed from a run without it."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first, self.norm, self.head = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)
            self.noise = torch.Generator().manual_seed(3)

        def forward(self, x):
            x = self.norm(self.first(x)) + torch.rand(16, generator=self.noise)
            return self.head(x)

    acc = Accelerator(cpu=True)
    model = Noisy()
    loader = DataLoader(torch.randn(12, 8), batch_size=4)
    prepared, optimizer, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step, batch in enumerate(loader, start=1):
            if step == 2:  # as of the last good step: what the skipped step puts back, replay or not
                stats = {name: b.clone() for name, b in model.named_buffers()}
            output = prepared(batch).float()
            acc.backward((output - 1e6).log().mean() if step == 2 else output.pow(2).mean())
            if step == 2:
                drawn = model.noise.get_state()
            optimizer.step()
            if step == 2:
                assert all(torch.equal(stats[name], b) for name, b in model.named_buffers())
                assert torch.equal(drawn, model.noise.get_state())
            optimizer.zero_grad()
    assert any("replayed" in str(w.message) for w in said)  # the replay ran
