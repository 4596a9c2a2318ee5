"""``accelerator.profile()``: torch.profiler with sensible defaults, a trace per rank and a summary."""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path
from typing import Iterator

import torch


def peak_memory_text(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak CUDA memory allocated: {torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB"
    return f"peak resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB"


@contextlib.contextmanager
def profile(
    output_dir: str | Path,
    rank: int,
    is_main: bool,
    device: torch.device,
    *,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    record_shapes: bool = True,
    profile_memory: bool = True,
    row_limit: int = 15,
) -> Iterator[torch.profiler.profile]:
    """Profile ``wait + warmup + active`` steps (call ``.step()`` on the yielded profiler each step).

    Every rank writes ``trace_rank{rank}.json`` (open it in Perfetto or chrome://tracing); the main
    process also writes ``summary.txt``: the top ops by self time and the peak memory.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(output_dir / f"trace_rank{rank}.json"))
        if is_main:
            table = prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)
            summary = (
                f"top {row_limit} ops by {sort_by} over {active} profiled steps\n{table}\n{peak_memory_text(device)}\n"
            )
            (output_dir / "summary.txt").write_text(summary)

    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        record_shapes=record_shapes,
        profile_memory=profile_memory,
    ) as prof:
        yield prof


@contextlib.contextmanager
def profile_as_accelerate(handler, rank: int, device: torch.device) -> Iterator[torch.profiler.profile]:
    """Accelerate's ``profile()``: torch.profiler with the ProfileKwargs given, profiling the whole
    block unless ``schedule_option`` sets a schedule; with ``output_trace_dir`` each rank writes
    ``trace_rank{rank}.json`` there at the end."""
    activities = handler.activities
    if activities is None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
    else:
        activities = [
            getattr(torch.profiler.ProfilerActivity, a.upper()) if isinstance(a, str) else a for a in activities
        ]
    schedule = torch.profiler.schedule(**handler.schedule_option) if handler.schedule_option else None
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=handler.on_trace_ready,
        record_shapes=handler.record_shapes,
        profile_memory=handler.profile_memory,
        with_stack=handler.with_stack,
        with_flops=handler.with_flops,
        with_modules=handler.with_modules,
    ) as prof:
        yield prof
    if handler.output_trace_dir:
        Path(handler.output_trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(handler.output_trace_dir) / f"trace_rank{rank}.json"))
