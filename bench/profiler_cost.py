"""What the profiler costs under fp8: lowbit against Accelerate and raw PyTorch/torchao, same model.

    python bench/profiler_cost.py               # 8 profiled steps per row
    python bench/profiler_cost.py --steps 20

Each row runs in its own process: the benchmark model (common.py) for ``--steps`` steps without
the profiler, then the same number inside a profiler that records every operation (Accelerate's
``accelerator.profile()`` with a ``ProfileKwargs(output_trace_dir=...)``, the form its
``by_feature/profiler.py`` uses; the raw loops use ``torch.profiler.profile`` the same way), trace
written. Printed per row: seconds per step without and with the profiler, their ratio, profiler
events per step and trace kilobytes per step. Emulated FP8 runs each cast and each scaled GEMM as
several plain operations, so it records more events per Linear than fp32 does; what matters is
whether lowbit records more than raw torchao does for the same conversion.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common import batch, make_model, median_seconds, print_table, step_fn

warnings.filterwarnings("ignore")
ROWS = [("raw", "no"), ("accelerate", "no"), ("lowbit", "no"), ("raw", "fp8"), ("accelerate", "fp8"), ("lowbit", "fp8")]


def build(library: str, precision: str):
    """(step function, profiler context factory) for one row."""
    trace_dir = tempfile.mkdtemp(prefix="profile-")
    if library == "raw":
        model = make_model()
        context = None
        if precision == "fp8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            from lowbit_ao.convert import default_module_filter

            module_filter, _ = default_module_filter(model, keep_first_last=True)
            config = dataclasses.replace(Float8LinearConfig(), emulate=not torch.cuda.is_available())
            convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
            context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731 - what lowbit's fp8 runs in
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        @contextlib.contextmanager
        def profiled():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                yield prof
            prof.export_chrome_trace(os.path.join(trace_dir, "trace.json"))

        return step_fn(model, optimizer, *batch(), context=context), profiled, trace_dir
    module = __import__(library)
    utils = __import__(f"{library}.utils", fromlist=["ProfileKwargs"])
    handlers = [utils.ProfileKwargs(output_trace_dir=trace_dir)]
    if precision == "fp8":
        handlers.append(utils.AORecipeKwargs())
    accelerator = module.Accelerator(cpu=True, mixed_precision=precision, kwargs_handlers=handlers)
    model, optimizer = accelerator.prepare(make_model(), torch.optim.AdamW(make_model().parameters(), lr=1e-4))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    return step_fn(model, optimizer, *batch(), backward=accelerator.backward), accelerator.profile, trace_dir


def measure(library: str, precision: str, steps: int) -> dict:
    step, profiled, trace_dir = build(library, precision)
    plain = median_seconds(step, steps, warmup=3)
    start = time.perf_counter()
    with profiled() as prof:
        for _ in range(steps):
            step()
    with_profiler = (time.perf_counter() - start) / steps
    trace_bytes = sum(f.stat().st_size for f in Path(trace_dir).rglob("*") if f.is_file())
    return {
        "plain": plain,
        "profiled": with_profiler,
        "events": len(prof.events()) / steps,
        "trace_kb": trace_bytes / 1024 / steps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--one", nargs=2, metavar=("LIBRARY", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        torch.set_num_threads(1)
        print(json.dumps(measure(*args.one, args.steps)))
        return 0
    rows = []
    for library, precision in ROWS:
        if library == "accelerate" and not _importable("accelerate"):
            continue
        proc = subprocess.run(
            [sys.executable, __file__, "--steps", str(args.steps), "--one", library, precision],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        )
        if proc.returncode != 0:
            rows.append((library, precision, "failed: " + proc.stderr.strip().splitlines()[-1][:80], "", "", "", ""))
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(
            (
                library,
                precision,
                r["plain"],
                r["profiled"],
                r["profiled"] / r["plain"],
                round(r["events"]),
                round(r["trace_kb"]),
            )
        )
    print_table(
        f"Profiler cost, {args.steps} steps per row (seconds per step; {_cpu()})",
        ("library", "precision", "s/step", "s/step profiled", "ratio", "events/step", "trace KB/step"),
        rows,
    )
    return 0


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _cpu() -> str:
    from lowbit.cli.env_command import describe_cpu

    return describe_cpu()


if __name__ == "__main__":
    sys.exit(main())
