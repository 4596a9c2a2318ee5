"""Checks that prepare a model with the backend and use it as a training run does: conversion,
forward under autocast, gradients, a few optimizer steps, odd shapes, resume, save_model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

from lowbit.conformance.setup import conversion_hook, default_model_factory, fail, in_features, prepare, teacher_data

from lowbit.kernel.types import HardwareInfo

TRAIN_STEPS = 8
BATCH = 16
LR = 5e-3
LOSS_MUST_FALL_TO = 0.9  # of the first step's loss, after TRAIN_STEPS steps
# Batch and token counts an FP8 layer must take: 1, odd, and one past a multiple of 32.
ODD_SHAPES = ((1,), (3,), (33,), (2, 1), (2, 3), (2, 33))


def _train(acc: Any, model: Any, optimizer: Any, x: Any, y: Any, steps: range, on_first_backward=None) -> list[float]:
    import torch

    losses = []
    for step in steps:
        batch = slice(step * BATCH % len(x), step * BATCH % len(x) + BATCH)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[batch].to(acc.device)).float(), y[batch].to(acc.device))
        acc.backward(loss)
        if on_first_backward is not None and step == steps[0]:
            on_first_backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def check_layers_converted(
    backend: str,
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
) -> list[str]:
    """At least one layer became an FP8 layer. Returns their names (the backend's own report when
    ``convert_model`` returns one, else the modules whose class changed)."""
    plain = model_factory()
    before = {name: type(module) for name, module in plain.named_modules()}
    acc, prepared, _ = prepare(backend, plugin, hardware, plain)
    model = acc.unwrap_model(prepared, keep_torch_compile=False)
    record = acc.run.prepared.conversion_reports.get(model)
    if record is not None:
        converted = list(record.converted)
    else:
        converted = [name for name, module in model.named_modules() if before.get(name) is not type(module)]
    if not converted:
        linears = [name for name, cls in before.items() if cls.__name__ == "Linear"]
        fail(
            backend,
            conversion_hook(acc),
            f"no layer was converted: all {len(linears)} Linear layers of the test model ({', '.join(linears)}) are "
            "unchanged after prepare(); expected at least one FP8 layer (does the hook return None, or does its "
            "module filter accept nothing?)",
        )
    return converted


def _rounding_tolerance(reference: Any, weight_storage: str) -> Any:
    """What storing ``reference`` in ``weight_storage`` may change it by, element by element:
    one unit in the last place, and for fp8 one per-tensor scale times the smallest normal."""
    import torch

    info = torch.finfo(getattr(torch, weight_storage))
    scale = reference.abs().amax() / info.max if weight_storage.startswith("float8") else 1.0
    return info.eps * reference.abs() + scale * info.smallest_normal


def check_conversion_keeps_weights(
    backend: str,
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
) -> float:
    """The prepared model's weights (``get_state_dict``) are the plain model's, bit for bit; for a
    backend whose description declares ``weight_storage`` (MS-AMP keeps weights in fp8), within
    that format's rounding. Returns the largest change."""
    import torch

    source = model_factory()
    original = {name: value.detach().clone() for name, value in source.state_dict().items()}
    acc, prepared, _ = prepare(backend, plugin, hardware, source)
    storage = getattr(acc.run.plugins.backend.chosen.description, "weight_storage", "") or ""
    state = acc.get_state_dict(prepared)
    largest = 0.0
    for name, want in original.items():
        if name not in state:
            fail(
                backend,
                "export_state_dict",
                f"{name} is missing from the prepared model's state dict; expected the plain model's names",
            )
        got, want = state[name].float(), want.float()
        change = (got - want).abs()
        largest = max(largest, change.max().item() if change.numel() else 0.0)
        ok = bool((change <= _rounding_tolerance(want, storage)).all()) if storage else torch.equal(got, want)
        if not ok:
            expected = (
                f"within {storage} rounding (declared weight_storage)"
                if storage
                else "bit for bit as they were (a backend that keeps weights in a lower precision declares it: "
                "BackendDescription(weight_storage='float8_e4m3fn'))"
            )
            fail(
                backend,
                conversion_hook(acc),
                f"conversion changed {name} by up to {change.max().item():.3g}; expected the weights {expected}",
            )
    return largest


def check_conversion_keeps_outputs_close(
    backend: str,
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
    rtol: float = 0.1,
) -> float:
    """The converted model's outputs stay within ``rtol`` (relative L2 error) of the plain model's."""
    import torch

    plain = model_factory()
    acc, prepared, _ = prepare(backend, plugin, hardware, copy.deepcopy(plain))
    x = torch.randn(32, in_features(plain), device=acc.device)
    with torch.no_grad():
        expected = plain.to(acc.device)(x).float()
        got = prepared(x).float()
    error = ((got - expected).norm() / expected.norm()).item()
    if not error <= rtol:
        fail(
            backend,
            conversion_hook(acc),
            f"converted outputs differ from the plain model's by {error:.3f} (relative L2); expected at most {rtol}",
        )
    return error


def check_autocast_nests_with_bf16(
    backend: str,
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
) -> None:
    """Inside a prepared model's forward, native bf16 autocast is on (the backend's context nests in it)."""
    import torch

    acc, prepared, _ = prepare(backend, plugin, hardware, model_factory())
    seen = []
    inner = next(m for m in prepared.modules() if m is not prepared)
    inner.register_forward_pre_hook(
        lambda m, args: seen.append(
            (torch.is_autocast_enabled(acc.device.type), torch.get_autocast_dtype(acc.device.type))
        )
    )
    prepared(torch.randn(4, in_features(prepared), device=acc.device))
    if not (seen and seen[0] == (True, torch.bfloat16)):
        fail(
            backend,
            "autocast_context",
            f"the forward ran with autocast state {seen[:1]}; expected bf16 autocast (nest inside it, do not replace "
            "it)",
        )


def _check_gradients(backend: str, hook: str, model: Any) -> None:
    import torch

    problems = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad
        if grad is None:
            problems.append(f"{name}: no gradient")
        elif not bool(torch.isfinite(grad).all()):
            problems.append(f"{name}: non-finite gradient")
        elif not bool(grad.abs().sum() > 0):
            problems.append(f"{name}: all-zero gradient")
    if problems:
        fail(
            backend,
            hook,
            f"after backward, {'; '.join(problems)}; expected every trainable parameter to get a finite, "
            "non-zero gradient (does an FP8 layer detach its weight or input?)",
        )


def check_training(
    backend: str,
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
) -> list[float]:
    """AdamW for TRAIN_STEPS steps on a random linear teacher: every trainable parameter gets a
    finite, non-zero gradient, and the loss falls below LOSS_MUST_FALL_TO of the first. Returns the losses."""
    import math

    source = model_factory()
    x, y = teacher_data(source)
    acc, model, optimizer = prepare(backend, plugin, hardware, source, lr=LR)
    hook = conversion_hook(acc)
    losses = _train(
        acc,
        model,
        optimizer,
        x,
        y,
        range(TRAIN_STEPS),
        on_first_backward=lambda: _check_gradients(backend, hook, acc.unwrap_model(model, keep_torch_compile=False)),
    )
    if not all(math.isfinite(loss) for loss in losses) or not losses[-1] < LOSS_MUST_FALL_TO * losses[0]:
        fail(
            backend,
            hook,
            f"the loss did not fall in {TRAIN_STEPS} AdamW steps (lr {LR}): {[round(v, 4) for v in losses]}; "
            f"expected the last below {LOSS_MUST_FALL_TO} x the first",
        )
    return losses


def check_odd_sizes(
    backend: str,
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
) -> None:
    """Forward and backward on 1, 3 and 33 rows, and on sequences of 1, 3 and 33 tokens."""
    import torch

    acc, model, _ = prepare(backend, plugin, hardware, model_factory())
    features = in_features(model)
    for leading in ODD_SHAPES:
        shape = (*leading, features)
        x = torch.randn(shape, device=acc.device, requires_grad=True)
        try:
            out = model(x)
            out.float().sum().backward()
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            fail(
                backend,
                conversion_hook(acc),
                f"the converted model fails on an input of shape {shape}: "
                f"{type(exc).__name__}: {exc}; expected FP8 layers to take any number of "
                "rows and tokens (pad inside the layer when a kernel needs multiples)",
            )
        if tuple(out.shape[:-1]) != tuple(leading) or not bool(torch.isfinite(out).all()):
            fail(
                backend,
                conversion_hook(acc),
                f"input of shape {shape} gave an output of shape {tuple(out.shape)} "
                f"(finite: {bool(torch.isfinite(out).all())}); expected {(*leading, '...')}, finite",
            )


def check_resume(
    backend: str,
    tmp_path: Path,
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
) -> None:
    """Two steps, ``save_state``, two more; a new run that ``load_state``s takes the same two steps
    to the same losses (rtol 1e-5)."""
    import torch

    x, y = teacher_data(model_factory())
    acc, model, optimizer = prepare(backend, plugin, hardware, model_factory(), lr=LR)
    _train(acc, model, optimizer, x, y, range(2))
    acc.save_state(tmp_path)
    uninterrupted = _train(acc, model, optimizer, x, y, range(2, 4))
    acc2, model2, optimizer2 = prepare(backend, plugin, hardware, model_factory(), lr=LR)
    acc2.load_state(tmp_path)
    resumed = _train(acc2, model2, optimizer2, x, y, range(2, 4))
    if not torch.allclose(torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-5, atol=0):
        fail(
            backend,
            "save_state/load_state",
            f"after load_state the losses are {resumed}, the uninterrupted run's "
            f"{uninterrupted}; expected the same (keep every FP8 state, such as "
            "scales and amax histories, in the model's or optimizer's state_dict)",
        )


def check_save_model_is_portable(
    backend: str,
    tmp_path: Path,
    plugin: object | None = None,
    hardware: HardwareInfo | None = None,
    model_factory: Callable[[], Any] = default_model_factory,
) -> None:
    """``save_model`` writes a file the plain, unconverted model loads strictly, with the prepared model's values."""
    import torch
    from safetensors.torch import load_file

    acc, prepared, _ = prepare(backend, plugin, hardware, model_factory())
    expected = acc.get_state_dict(prepared)
    state = load_file(acc.save_model(prepared, tmp_path))
    plain = model_factory()
    try:
        plain.load_state_dict(state)  # strict: every name present, none extra
    except RuntimeError as exc:
        fail(backend, "export_state_dict", f"the save_model file does not load strictly into the plain model: {exc}")
    for name, value in plain.state_dict().items():
        if not torch.equal(value.float(), expected[name].float()):
            fail(backend, "export_state_dict", f"{name} in the save_model file differs from the prepared model's")
