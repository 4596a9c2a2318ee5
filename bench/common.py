"""Shared pieces of the benchmarks: the model, the batches, and side-by-side timing.

Absolute times on shared machines are noise, so every benchmark reports ratios of two loops
measured in the same process, alternating rounds so that both see the same machine state.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn

WIDTH, DEPTH, BATCH = 512, 4, 256
# One thread: with 2 cores shared with the OS, two threads make per-step times jitter far more
# than the overhead being measured. Ratios, not absolute speed, are the point here.
torch.set_num_threads(1)


def make_model(seed: int = 0, width: int = WIDTH, depth: int = DEPTH) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(width, width)]
    for _ in range(depth):
        layers += [nn.GELU(), nn.Linear(width, width)]
    return nn.Sequential(*layers)


def batch(width: int = WIDTH, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(size, width, generator=g), torch.randn(size, width, generator=g)


def step_fn(
    model: nn.Module, optimizer, x, y, backward: Callable | None = None, context: Callable | None = None
) -> Callable[[], None]:
    """One training step. ``context`` wraps the forward (raw loops' autocast); ``backward`` is
    ``accelerator.backward`` for lowbit loops."""

    def step() -> None:
        optimizer.zero_grad()
        if context is None:
            out = model(x)
        else:
            with context():
                out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        (backward or (lambda l: l.backward()))(loss)
        optimizer.step()

    return step


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(
    a: Callable[[], None], b: Callable[[], None], warmup: int = 10, pairs: int = 300
) -> tuple[float, float, float]:
    """Median step seconds of ``a`` and ``b``, and the median of per-pair ratios a/b.

    Steps run in adjacent pairs (a-then-b, then b-then-a), so both sides of each ratio see the
    same machine state; the median of many pair ratios shrugs off the machine's bursts."""
    for _ in range(warmup):
        a()
        b()
    times_a, times_b, ratios = [], [], []
    for i in range(pairs):
        measured = {}
        for fn in (a, b) if i % 2 == 0 else (b, a):
            start = time.perf_counter()
            fn()
            measured[fn] = time.perf_counter() - start
        times_a.append(measured[a])
        times_b.append(measured[b])
        ratios.append(measured[a] / measured[b])
    return statistics.median(times_a), statistics.median(times_b), statistics.median(ratios)


def lowbit_loop(
    precision: str,
    compiled: bool = False,
    handlers: list | None = None,
    telemetry_every: int | None = None,
    check_gradients: bool = True,
):
    """A lowbit training step on the benchmark model (``check_gradients=False``: without the
    optimizer step's non-finite gradient check, to measure what it costs)."""
    from lowbit import Accelerator

    acc = Accelerator(
        mixed_precision=precision, kwargs_handlers=handlers or [], dynamo_backend="inductor" if compiled else None
    )
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    acc._run.step_state.check_gradients = check_gradients
    if telemetry_every:
        acc.enable_fp8_telemetry(every_n_steps=telemetry_every)
    return step_fn(model, opt, *batch(), backward=acc.backward)


def print_table(title: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(_fmt(v).ljust(w) for v, w in zip(row, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
