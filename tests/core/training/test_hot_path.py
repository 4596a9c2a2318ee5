"""The hot path: decided once at prepare(), plain torch after.

A steady-state step makes no plugin call; torch.compile of a prepared model compiles, once, with
no graph break (every default on, the throughput meter included); AutocastKwargs is honoured.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_llama
from torch import nn
from torch.utils.data import DataLoader

from lowbit import Accelerator
from lowbit.utils import AORecipeKwargs, AutocastKwargs, TorchDynamoPlugin

PRECISIONS = ["no", "bf16", "fp16", "fp8-tensorwise", "fp8-rowwise"]


def accelerator_for(precision: str, **kwargs) -> Accelerator:
    if precision.startswith("fp8"):
        pytest.importorskip("torchao")
        recipe = precision.split("-")[1]
        # every layer in FP8 (the default keeps the first and last in bf16)
        options = AORecipeKwargs(recipe=recipe, keep_first_last_high_precision=False)
        return Accelerator(
            mixed_precision="fp8", cpu=True, kwargs_handlers=[options, *kwargs.pop("handlers", [])], **kwargs
        )
    return Accelerator(mixed_precision=precision, cpu=True, kwargs_handlers=kwargs.pop("handlers", []), **kwargs)


class BlockMLP(nn.Module):
    """An input Linear, repeated blocks in a ModuleList (what regional compilation compiles), a head."""

    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks))
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model_and_data(width: int = 64, blocks: int = 2):
    torch.manual_seed(0)
    data = [(torch.randn(32), torch.randn(16)) for _ in range(16 * 12)]
    return BlockMLP(width, blocks), DataLoader(data, batch_size=16)


def stepper(accelerator: Accelerator, run, optimizer, loader):
    """``run_steps(n)``: n training steps of ``run`` (the prepared model, or a compiled one) on the loader's batches."""
    batches = iter(loader)

    def run_steps(n):
        for _ in range(n):
            x, y = next(batches)
            accelerator.backward(nn.functional.mse_loss(run(x), y))
            optimizer.step()
            optimizer.zero_grad()

    return run_steps


@pytest.mark.parametrize("precision", ["no", "bf16", "fp8-tensorwise"])
def test_a_steady_state_step_makes_no_plugin_call(precision):
    accelerator = accelerator_for(precision)
    model, loader = model_and_data()
    calls: list[str] = []
    manager = accelerator._run.plugin_manager
    real = manager._inner_hookexec

    def counting(hook_name, *args, **kwargs):
        calls.append(hook_name)
        return real(hook_name, *args, **kwargs)

    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    batches = iter(loader)

    def step():
        x, y = next(batches)
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # the first step counts the FLOPs, once
        step()
    manager._inner_hookexec = counting
    try:
        for _ in range(10):
            step()
    finally:
        manager._inner_hookexec = real
    assert calls == []


# lowbit's Python frames per call on a steady-state step of a 2-Linear model (sys.setprofile):
# backward is the facade's handoff, the run's, the preemption check at an iteration's start, the
# finite flag and the precision's backward; the optimizer step is the prepared optimizer, the
# gradient check and its one host read, the precision's step and the step's observers. Every frame
# here is paid at every step, so a new one is a choice this budget makes visible.
BACKWARD_FRAMES = 5
STEP_FRAMES = 14  # 12 on Python 3.11 (a list comprehension is a frame there; 3.12 inlines it)


def lowbit_frames(call) -> dict[str, int]:
    """The frames of lowbit's core that ``call()`` runs, by function. A backend's own frames are the
    model's compute (on a CPU, torchao's emulated FP8 GEMMs run inside backward), not the step's cost."""
    import collections
    import os
    import sys

    import lowbit

    roots = (os.path.dirname(lowbit.__file__) + os.sep,)
    seen: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            seen[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return dict(seen)


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16", "fp8-tensorwise"])
def test_a_steady_state_step_runs_within_its_frame_budget(precision):
    accelerator = accelerator_for(precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    for _ in range(3):  # the first step counts the FLOPs, once
        loss = nn.functional.mse_loss(model(x), y)
        backward = lowbit_frames(lambda: accelerator.backward(loss))
        step = lowbit_frames(optimizer.step)
        optimizer.zero_grad()
    print(f"frames: backward {sum(backward.values())}, step {sum(step.values())}")  # pytest -s
    assert sum(backward.values()) <= BACKWARD_FRAMES, backward
    assert sum(step.values()) <= STEP_FRAMES, step
    assert "training_run.py:backward" in backward  # the count sees lowbit's frames at all


def test_autocast_kwargs_are_honoured():
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append(torch.is_autocast_enabled("cpu"))
            return super().forward(x)

    accelerator = Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[AutocastKwargs(enabled=False)])
    model = accelerator.prepare(Probe(4, 4))
    assert model(torch.randn(2, 4)).dtype == torch.float32 and seen == [False]
    on = Accelerator(mixed_precision="bf16", cpu=True)
    model = on.prepare(Probe(4, 4))
    model(torch.randn(2, 4))
    assert seen == [False, True]
    with on.autocast(autocast_handler=AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
    with on.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def _dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _compiles_once(run_steps) -> None:
    """``run_steps(n)`` trains n steps; after the first, no new graph and never a graph break."""
    run_steps(1)
    graphs, breaks = _dynamo_counts()
    assert graphs >= 1 and breaks == 0, (graphs, breaks)
    run_steps(9)
    assert _dynamo_counts() == (graphs, 0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_torch_compile_of_a_prepared_model_compiles_once_with_fullgraph(precision, fresh_dynamo):
    """With every default on (the meter included), torch.compile(prepared, fullgraph=True):
    graphs compiled, no recompile after the first step, no graph break."""
    accelerator = accelerator_for(precision)
    model, loader = model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _compiles_once(stepper(accelerator, compiled, optimizer, loader))
    assert accelerator.throughput.get("throughput/tflops_per_device", 0) > 0  # the meter measured all the same


@pytest.mark.parametrize("regional", [False, True])
def test_dynamo_backend_and_regional_compilation_compile_once(regional, fresh_dynamo):
    plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=True, use_regional_compilation=regional)
    accelerator = accelerator_for("fp8-tensorwise", dynamo_plugin=plugin)
    model, loader = model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    _compiles_once(stepper(accelerator, model, optimizer, loader))


def test_dynamo_backend_inductor_compiles(fresh_dynamo):
    """The real compiler once (C++ code generated on this CPU), bf16."""
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, dynamo_backend="inductor")
    model, loader = model_and_data(width=32, blocks=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    _compiles_once(stepper(accelerator, model, optimizer, loader))


def test_a_model_compiled_before_prepare_stays_compiled(fresh_dynamo):
    accelerator = accelerator_for("bf16")
    model, loader = model_and_data()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled, optimizer, loader = accelerator.prepare(compiled, optimizer, loader)
    _compiles_once(stepper(accelerator, compiled, optimizer, loader))


class _HostReads:
    """Counts what reads a device value on the host (``.item()``, ``bool()`` of a tensor: both run
    ``aten._local_scalar_dense``, a host sync on a GPU) and collectives, inside the block."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {"reads": 0, "collectives": 0}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counts["reads"] += 1
                if func.namespace == "c10d":
                    counts["collectives"] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize(
    "precision, on_nonfinite_loss, reads",
    [
        ("bf16", "continue", 0),  # Accelerate's behaviour: nothing read
        ("bf16", "skip", 1),  # lowbit's default: the one read of the step's finite verdict
        ("no", "skip", 1),
        ("fp16", "skip", 1),  # the loss scaler's own read of its inf check, nothing of lowbit's
        ("fp8-tensorwise", "continue", 0),
    ],
)
def test_a_steady_state_step_reads_the_device_only_where_asked(precision, on_nonfinite_loss, reads):
    accelerator = accelerator_for(precision, on_nonfinite_loss=on_nonfinite_loss)
    accelerator.on_preemption(lambda: None)  # the preemption poll is on, too
    model, loader = model_and_data()
    # SGD: AdamW on a CPU reads each parameter's step count (.item()) itself
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), loader
    )
    batches = iter(loader)
    for step in range(4):
        x, y = next(batches)
        with _HostReads() as seen:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if step >= 2:  # the first step also counts the FLOPs (on meta, no device read)
            assert seen.counts == {"reads": reads, "collectives": 0}, (step, seen.counts)


@pytest.mark.parametrize("precision", ["bf16", "fp8-tensorwise"])
def test_a_transformers_llama_compiled_after_prepare_compiles_once(precision, fresh_dynamo):
    """The GPU run's setup, small: a grouped-query Llama, torch.compile after prepare, every default on."""
    model = tiny_llama(vocab_size=256, use_cache=False)
    ids = [torch.randint(0, 256, (32,)) for _ in range(4 * 12)]
    loader = DataLoader(ids, batch_size=4, collate_fn=lambda b: {"input_ids": torch.stack(b), "labels": torch.stack(b)})
    accelerator = accelerator_for(precision)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3), loader)
    compiled = torch.compile(model, backend="aot_eager")
    batches = iter(loader)

    def run_steps(n):
        for _ in range(n):
            accelerator.backward(compiled(**next(batches)).loss)
            optimizer.step()
            optimizer.zero_grad()

    _compiles_once(run_steps)
    assert accelerator.throughput["throughput/tflops_per_device"] > 0  # grouped-query attention counted


def test_counting_a_compiled_models_work_leaves_it_compiling(fresh_dynamo):
    """prepare() on a GPU counts the model's work for the FP8 report (report_work); a model compiled
    before prepare() must still compile afterwards (dynamo marked the frames it met under the
    tracer's modes to be skipped for good)."""
    from lowbit.runtime.observe.fp8_payoff import count_work

    model, _ = model_and_data()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    count_work(compiled, 2, 32)
    compiled(torch.randn(4, 32)).sum().backward()
    assert _dynamo_counts() == (1, 0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the reduction each device gets (computed here on CPU tensors)
def test_the_gradient_verdict_catches_nan_and_inf_either_way(device):
    from lowbit.runtime.training.prepared import finite_reduction

    grads = [torch.randn(64, 64), torch.randn(64).bfloat16()]
    assert torch.isfinite(finite_reduction(grads, torch.device(device))).all()
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = [g.clone() for g in grads]
        poisoned[1][3] = bad
        assert not torch.isfinite(finite_reduction(poisoned, torch.device(device))).all(), bad


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the reduction each device gets (computed here on CPU tensors)
def test_finite_fp16_gradients_with_a_norm_past_fp16s_range_are_finite(device):
    """fp16 weights without a scaler: a gradient norm of ~95,000 (each value finite) is no overflow."""
    from lowbit.runtime.training.prepared import finite_reduction

    grads = [torch.full((100_000,), 300.0, dtype=torch.float16), torch.ones(8, dtype=torch.float16)]
    assert torch.isfinite(finite_reduction(grads, torch.device(device))).all()
