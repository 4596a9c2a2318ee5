"""The Accelerator with the built-in plugins: precision, prepare, accumulation, checkpoints."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from helpers import FakeBackend, manager_with, mlp, regression_data
from safetensors.torch import load_file
from torch import nn

from lowbit import Accelerator, hookimpl
from lowbit.cli.self_test import train_steps
from lowbit.utils import FP8RecipeKwargs

from lowbit.kernel.errors import BackendUnavailableError, ConfigError

from lowbit.runtime.training.prepared import PreparedOptimizer


def no_fp8_manager():
    return manager_with()  # built-ins only: no FP8 backend at all


def train(acc, model, opt, x, y, steps, sched=None):
    return train_steps(acc, model, opt, x, y, steps, scheduler=sched)


def test_prepare_returns_objects_in_the_order_given():
    acc = Accelerator(plugin_manager=no_fp8_manager())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*regression_data(16)), batch_size=4)
    out = acc.prepare(loader, sched, model, opt)
    assert isinstance(out[0].base, torch.utils.data.DataLoader)
    assert out[1].scheduler is sched and out[2] is model and isinstance(out[3], PreparedOptimizer)
    assert acc.prepare(mlp()) is not None  # one object comes back as itself


def test_prepare_rejects_unsupported_objects():
    acc = Accelerator(plugin_manager=no_fp8_manager())
    with pytest.raises(TypeError, match=r"argument 1 is a builtins.str.*cannot prepare"):
        acc.prepare(mlp(), "not a model")


def test_bf16_autocast_on_cpu_and_fp32_outputs():
    acc = Accelerator(mixed_precision="bf16", plugin_manager=no_fp8_manager())
    model = acc.prepare(nn.Sequential(nn.Linear(8, 8)))
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(torch.randn(2, 8))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    with acc.autocast():
        assert (torch.randn(2, 8) @ torch.randn(8, 8)).dtype == torch.bfloat16


def test_fp16_skips_steps_with_inf_grads_and_the_scheduler_waits():
    acc = Accelerator(mixed_precision="fp16", plugin_manager=no_fp8_manager())
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    before = model.weight.detach().clone()
    scale = acc.scaler.get_scale()
    opt.zero_grad()
    acc.backward(model(torch.randn(4, 8)).sum() * float("inf"))
    opt.step()
    sched.step()
    assert opt.step_was_skipped
    assert torch.equal(model.weight, before)
    assert acc.scaler.get_scale() < scale
    assert sched.get_last_lr() == [0.1]
    opt.zero_grad()
    acc.backward(model(torch.randn(4, 8)).mean() * 1e-3)  # small enough not to overflow fp16 once scaled
    opt.step()
    sched.step()
    assert not opt.step_was_skipped and not torch.equal(model.weight, before)
    assert sched.get_last_lr() == [0.05]


def test_fp16_clip_grad_norm_unscales_first():
    acc = Accelerator(mixed_precision="fp16", plugin_manager=no_fp8_manager())
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.ones(4, 8)).mean() * 1e-2)
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    # Unscaled gradient of 0.01 * mean: 0.01 for each of 8 weights and the bias -> norm 0.03.
    assert norm.item() == pytest.approx(0.03, rel=1e-2)


def test_gradient_accumulation_matches_one_big_batch():
    x, y = regression_data(32)
    big = mlp()
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    opt_big.zero_grad()
    nn.functional.mse_loss(big(x), y).backward()
    opt_big.step()

    acc = Accelerator(gradient_accumulation_steps=4, plugin_manager=no_fp8_manager())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for chunk_x, chunk_y in zip(x.chunk(4), y.chunk(4)):
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(chunk_x), chunk_y))
            opt.step()
            opt.zero_grad()
    for a, b in zip(big.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)


def test_two_accelerators_with_different_settings_coexist():
    a = Accelerator(mixed_precision="bf16", plugin_manager=no_fp8_manager())
    b = Accelerator(mixed_precision="no", plugin_manager=no_fp8_manager())
    assert (a.mixed_precision, b.mixed_precision) == ("bf16", "no")
    assert b.prepare(nn.Linear(4, 4))(torch.randn(1, 4)).dtype == torch.float32


def test_fp8_with_no_backend_is_an_error_naming_hardware_and_install():
    with pytest.raises(BackendUnavailableError, match=r"Detected hardware: CPU.*pip install lowbit-ao.*fp8_fallback"):
        Accelerator(mixed_precision="fp8", plugin_manager=no_fp8_manager())


def test_fp8_fallback_warns_once_and_trains_in_bf16():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(mixed_precision="fp8", fp8_fallback="bf16", plugin_manager=no_fp8_manager())
    messages = [str(w.message) for w in caught if "falls back to bf16" in str(w.message)]
    assert len(messages) == 1 and acc.mixed_precision == "bf16" and acc.fp8_backend is None


def test_installed_but_unusable_backend_is_an_error():
    manager = manager_with(FakeBackend("gpuonly", 300, available=False, reason="needs CUDA; found CPU"))
    with pytest.raises(BackendUnavailableError, match=r"installed but cannot run here: needs CUDA; found CPU"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="gpuonly")], plugin_manager=manager)


def test_explain_lists_every_backend_with_priority_and_reason():
    manager = manager_with(
        FakeBackend("big", 300, available=False, reason="msamp not importable"), FakeBackend("small", 100)
    )
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager)
    text = acc.explain_backend_choice()
    assert acc.fp8_backend == "small"
    assert "big" in text and "300" in text and "msamp not importable" in text and "chosen" in text


def test_both_handler_spellings_at_once_is_an_error():
    with pytest.raises(ConfigError, match="not both"):
        Accelerator(kwargs_handlers=[], kwarg_handlers=[], plugin_manager=no_fp8_manager())


def test_save_model_is_a_plain_state_dict(tmp_path):
    acc = Accelerator(mixed_precision="bf16", plugin_manager=no_fp8_manager())
    model = acc.prepare(mlp())
    path = acc.save_model(model, tmp_path)
    plain = mlp(seed=5)
    plain.load_state_dict(load_file(path))
    for a, b in zip(plain.parameters(), acc.unwrap_model(model).parameters()):
        assert torch.equal(a, b)


class RecordingContextBackend(FakeBackend):
    """An FP8 backend whose autocast context records the native autocast state around it."""

    def __init__(self):
        super().__init__("nesting", 300)
        self.events: list[tuple[str, bool]] = []

    @hookimpl
    def autocast_context(self, model, context):
        backend = self

        @contextlib.contextmanager
        def recording():
            backend.events.append(("enter", torch.is_autocast_enabled("cpu")))
            yield
            backend.events.append(("exit", torch.is_autocast_enabled("cpu")))

        return recording


def test_autocast_nests_the_fp8_context_inside_bf16_autocast():
    """Outside forward too: bf16 autocast is entered first and left last, the backend's context
    runs inside it (an FP8 library sees autocast on, as in a prepared model's forward)."""
    backend = RecordingContextBackend()
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(backend))
    assert not torch.is_autocast_enabled("cpu")
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        backend.events.append(("body", torch.is_autocast_enabled("cpu")))
    assert not torch.is_autocast_enabled("cpu")
    assert backend.events == [("enter", True), ("body", True), ("exit", True)]


@pytest.mark.parametrize("native_bf16", [True, False])
def test_slow_precisions_on_this_cpu_are_named(monkeypatch, native_bf16):
    from lowbit.accelerator import SlowPrecisionNotice

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.warns(SlowPrecisionNotice, match="bf16 is the low-precision choice on CPUs"):
        Accelerator(mixed_precision="fp16")
    if native_bf16:
        with warnings.catch_warnings():
            warnings.simplefilter("error", SlowPrecisionNotice)
            Accelerator(mixed_precision="bf16")
    else:
        with pytest.warns(SlowPrecisionNotice, match="no native bf16"):
            Accelerator(mixed_precision="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPrecisionNotice)
        Accelerator(mixed_precision="no")


def test_init_trackers_twice_keeps_and_finishes_both_runs(tmp_path):
    """The first run's tracker was dropped unfinished, losing what it buffered; Accelerate keeps
    both, logs to both and finishes both; lowbit too, and says so (a script rarely means it)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    acc.init_trackers("first")
    acc.log({"loss": 1.5}, step=0)
    with pytest.warns(UserWarning, match=r"init_trackers\('second'\) was called while trackers of an earlier"):
        acc.init_trackers("second")
    acc.log({"loss": 0.5}, step=1)
    acc.end_training()
    assert acc.trackers == []
    for run, steps in (("first", [0, 1]), ("second", [1])):
        events = EventAccumulator(str(tmp_path / run))
        events.Reload()
        assert [e.step for e in events.Scalars("loss")] == steps, run


def test_fp16_overflowing_at_every_step_is_said_with_the_loss_scale(recwarn):
    """40 of 40 steps skipped and the scale down to 6e-8 went unsaid (Accelerate is silent too)."""
    from lowbit.kernel.notices import LowbitWarning, reset

    reset()
    acc = Accelerator(mixed_precision="fp16", plugin_manager=no_fp8_manager())
    model = nn.Linear(8, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(16):
        opt.zero_grad()
        acc.backward(model(torch.randn(4, 8)).sum() * float("inf"))
        opt.step()
    said = [str(w.message) for w in recwarn if issubclass(w.category, LowbitWarning)]
    assert len(said) == 2, said
    assert "the last 8 optimizer steps were all skipped" in said[0] and "loss scale fell to 256" in said[0]
    assert "the last 16 optimizer steps" in said[1] and "Train in bf16" in said[1]
    opt.zero_grad()
    acc.backward(model(torch.randn(4, 8)).mean() * 1e-3)
    opt.step()
    assert not opt.step_was_skipped and acc.precision.consecutive_skips == 0


def test_regional_compilation_compiles_each_repeated_block_in_place():
    """TorchDynamoPlugin(use_regional_compilation=True), as Accelerate's FSDP2 + FP8 example asks:
    it was a TypeError (and ignored in a config file)."""
    from lowbit.utils import TorchDynamoPlugin

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(8, 16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))
            self.out = nn.Linear(16, 1)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    plugin = TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
    assert plugin.to_kwargs() == {"backend": "eager"}
    acc = Accelerator(dynamo_plugin=plugin, plugin_manager=no_fp8_manager())
    eager = Stack()
    model = acc.prepare(Stack())
    assert not hasattr(model, "_orig_mod")  # the model itself is not wrapped
    assert all(block._compiled_call_impl is not None for block in acc.unwrap_model(model).blocks)
    assert acc.unwrap_model(model).inp._compiled_call_impl is None
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), eager(x))


def test_unwrap_model_keeps_a_compiled_model_compiled_unless_asked_and_unwraps_data_parallel():
    """Accelerate's keep_torch_compile (default True); nn.DataParallel was left wrapped."""
    from lowbit.utils import extract_model_from_parallel

    acc = Accelerator(dynamo_backend="eager", plugin_manager=no_fp8_manager())
    plain = nn.Linear(4, 4)
    model = acc.prepare(plain)
    assert hasattr(acc.unwrap_model(model), "_orig_mod") and acc.unwrap_model(model)._orig_mod is plain
    assert acc.unwrap_model(model, keep_torch_compile=False) is plain
    assert sorted(acc.get_state_dict(model)) == ["bias", "weight"]  # the plain model's names, not _orig_mod.*
    assert extract_model_from_parallel(nn.DataParallel(plain)) is plain


def test_accelerate_public_api_details_behave_as_in_accelerate(tmp_path):
    """Each was a difference from Accelerate: a tracker subclass calling super().__init__() with no
    argument, prepare(..., None), dispatch_batches=False, the docs' fsdp_auto_wrap_policy spelling,
    FSDP2's set_mixed_precision, on_last_process, and log_with='tensorboard' without a directory."""
    from lowbit.tracking import GeneralTracker
    from lowbit.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin

    class MyTracker(GeneralTracker):
        name = "mine"

        def __init__(self):
            super().__init__()

    assert MyTracker().run_name == ""
    acc = Accelerator(plugin_manager=no_fp8_manager())
    model = nn.Linear(2, 2)
    prepared, nothing = acc.prepare(model, None)
    assert nothing is None and prepared is not None
    assert DataLoaderConfiguration(dispatch_batches=False).dispatch_batches is False
    plugin = FullyShardedDataParallelPlugin(fsdp_auto_wrap_policy="transformer_based_wrap")
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    plugin.set_mixed_precision("bf16")
    plugin.set_mixed_precision("fp16")  # the first one stays unless override=True, as in Accelerate
    assert plugin.mixed_precision == "bf16"
    ran = []
    acc.on_last_process(lambda: ran.append(True))()
    assert ran == [True]  # one process: it is the last one too
    with pytest.raises(ConfigError, match="'tensorboard' tracker writes files"):
        Accelerator(log_with="tensorboard", plugin_manager=no_fp8_manager())


def test_automatic_checkpoint_naming_numbers_keeps_total_limit_and_loads_the_newest(tmp_path):
    """save_state() with no directory was promised by lowbit's docstring and not implemented."""
    from lowbit.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config, plugin_manager=no_fp8_manager())
    model = acc.prepare(nn.Linear(2, 2))
    for value in (1.0, 2.0, 3.0):
        with torch.no_grad():
            model.weight.fill_(value)
        acc.save_state(safe_serialization=True)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    with torch.no_grad():
        model.weight.fill_(0.0)
    acc.load_state()
    assert torch.all(model.weight == 3.0) and config.iteration == 3
    with pytest.raises(ConfigError, match="needs a directory, or ProjectConfiguration"):
        Accelerator(plugin_manager=no_fp8_manager()).save_state()


def test_prepare_one_object_at_a_time_as_accelerates_methods():
    acc = Accelerator(mixed_precision="bf16", plugin_manager=no_fp8_manager())
    model = acc.prepare_model(nn.Linear(4, 2))
    optimizer = acc.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = acc.prepare_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1))
    loader = acc.prepare_data_loader(torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    assert acc._run.prepared.models == [model] and acc._run.prepared.optimizers == [optimizer]
    assert acc._run.prepared.schedulers == [scheduler] and acc._run.prepared.dataloaders == [loader]

    class Seen(nn.Linear):
        def forward(self, x):
            self.autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
            return super().forward(x)

    teacher = acc.prepare_model(Seen(4, 2), evaluation_mode=True)  # a model only evaluated: not distributed
    teacher(torch.randn(2, 4))
    assert all(m is not teacher for m in acc._run.prepared.models) and teacher.autocast == torch.bfloat16


def test_accelerate_tensor_utilities():
    """utils.listify, concatenate, convert_to_fp32, convert_outputs_to_fp32 and
    recursively_apply(error_on_other_type=...), as in Accelerate's utils.operations."""
    from lowbit.utils import concatenate, convert_outputs_to_fp32, convert_to_fp32, listify, recursively_apply

    nest = {"a": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "b": [torch.tensor([3], dtype=torch.int64)]}
    assert listify(nest) == {"a": [1.0, 2.0], "b": [[3]]}
    converted = convert_to_fp32(nest)
    assert converted["a"].dtype == torch.float32 and converted["b"][0].dtype == torch.int64
    joined = concatenate([{"x": torch.ones(2, 3)}, {"x": torch.zeros(1, 3)}])
    assert joined["x"].shape == (3, 3)
    half = convert_outputs_to_fp32(lambda x: (x.half(), x.half() * 2))
    assert [t.dtype for t in half(torch.ones(2))] == [torch.float32, torch.float32]
    assert recursively_apply(lambda t, k: t * k, [torch.ones(2)], 3)[0].tolist() == [3.0, 3.0]
    with pytest.raises(TypeError, match="Unsupported type str"):
        recursively_apply(lambda t: t, {"a": "text"}, error_on_other_type=True)


def test_resetting_the_state_leaves_an_accelerator_working():
    """Accelerate's AcceleratorState._reset_state() breaks the Accelerators made before it (their
    prepare raises); lowbit keeps no process-global precision, so an Accelerator goes on working
    (docs/coming-from-accelerate.md, "Settings belong to an Accelerator")."""
    from lowbit import Accelerator
    from lowbit.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    AcceleratorState._reset_state()
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    assert model(torch.ones(1, 2)).shape == (1, 1)


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_explain_backend_choice_answers_without_a_low_precision_backend(precision):
    """The README and troubleshooting tell users to call it; it raised KeyError off FP8 (#56)."""
    text = Accelerator(cpu=True, mixed_precision=precision).explain_backend_choice()
    assert f"mixed_precision={precision!r}" in text and "no low-precision backend in use" in text
    assert "ao " in text  # the installed backends are listed, none chosen


def fp16_accumulating(clip_every_micro_batch: bool):
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=2)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    for step in range(4):
        with acc.accumulate(model):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            acc.backward(model(x).float().pow(2).mean())
            if clip_every_micro_batch or acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1e9)
            optimizer.step()
            optimizer.zero_grad()
    return model


def test_fp16_gradients_unscaled_on_a_micro_batch_that_does_not_step_are_refused():
    """Unscaled at every micro-batch, the next micro-batch's scaled gradients were added to unscaled
    ones: weights 1.2e3 off, no error (Accelerate's GradScaler raises at the second unscale)."""
    with pytest.raises(Exception, match="fp16: gradients unscaled .* on a micro-batch that does not step"):
        fp16_accumulating(clip_every_micro_batch=True)
    fp16_accumulating(clip_every_micro_batch=False)  # the documented pattern: clipped on the stepping micro-batch
