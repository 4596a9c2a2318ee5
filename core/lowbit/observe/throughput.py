"""How fast a run trains, measured while it trains, with no code in the script.

Tokens and samples are counted from the batches the prepared dataloaders hand out (``input_ids``,
else the first 2-D integer tensor; ``accelerator.set_batch_tokens(n)`` tells another count), the
time between optimizer steps from the clock, and the model's FLOPs once, on the first training
micro-batch, by torch's ``FlopCounterMode`` (forward and backward as they really run: attention,
the backend's GEMMs). MFU is against the device's dense bf16 peak (``GPU_PEAKS``, each with its
source; on a CPU a GEMM peak measured once and cached), also for FP8 runs, whose share of GEMM
FLOPs that ran as FP8 GEMMs is said beside it: one peak does not describe a mixed run.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lowbit.observe.gpu_specs import DevicePeak, gpu_peak

# Env: seconds between the progress lines (0: none), and 0 to turn the meter off.
EVERY_ENV = "LOWBIT_THROUGHPUT_EVERY"
OFF_ENV = "LOWBIT_THROUGHPUT"
DEFAULT_EVERY_S = 30.0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak(dtype: torch.dtype, cache: Path | None = None) -> DevicePeak:
    """This CPU's GEMM rate in ``dtype`` (TFLOP/s, best of a few 1024x1024 matmuls on the threads
    torch uses), measured once per CPU model, thread count and torch version, then cached."""
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowbit" / "cpu_peak.json"
    key = f"{_cpu_model()}|{torch.get_num_threads()} threads|torch {torch.__version__}|{dtype}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        known[key] = 2 * 1024**3 / best / 1e12
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known, indent=1))
        except OSError:
            pass  # read-only home: measured again next run
    name = f"{_cpu_model()} ({str(dtype).removeprefix('torch.')} GEMM, measured)"
    return DevicePeak(name, known[key], None, f"measured here, cached in {cache}")


def batch_counts(batch: Any) -> tuple[int, int | None]:
    """Samples (the first tensor's first dimension) and tokens (``input_ids``' elements, else the
    first 2-D integer tensor's) of a batch; tokens None when there is no such tensor."""
    tensors = list(_tensors(batch))
    if not tensors:
        return 0, None
    samples = int(tensors[0].shape[0]) if tensors[0].dim() else 1
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    if not isinstance(ids, torch.Tensor):
        ids = next((t for t in tensors if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()), None)
    return samples, (int(ids.numel()) if ids is not None else None)


def _tensors(data: Any):
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, dict) or hasattr(data, "values") and hasattr(data, "keys"):
        for value in data.values():
            yield from _tensors(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            yield from _tensors(value)


class ThroughputMeter:
    """Counts a run's work between optimizer steps; ``latest`` holds the stable-named figures of
    the last step (``throughput/...``), printed every ``every_s`` seconds on the main process."""

    def __init__(self, device: torch.device, num_processes: int, precision: str, is_main: bool,
                 say: Callable[[str], None] = print):
        self.device, self.num_processes, self.precision, self.is_main, self.say = device, num_processes, precision, is_main, say
        self.every_s = float(os.environ.get(EVERY_ENV, DEFAULT_EVERY_S))
        self.latest: dict[str, float] = {}
        self.flops_per_unit: float | None = None  # per token, or per sample when batches have no tokens
        self.parameters = 0  # the trained model's, to tell a count that missed the GEMMs
        self.fp8_gemm_share: float | None = None
        self.steps = 0
        self._peak: DevicePeak | None = None
        self._forward: tuple[float, dict[str, float]] | None = None  # the first training forward's count
        self._batch: tuple[int, int | None] = (0, None)
        self._since: dict[str, float] = {"samples": 0, "tokens": 0, "wait": 0.0}
        self._last_step = self._last_said = time.perf_counter()

    # ------------------------------------------------------------------ what the run tells it

    def on_batch(self, batch: Any, wait_s: float) -> None:
        self._batch = batch_counts(batch)
        self._since["samples"] += self._batch[0]
        self._since["tokens"] += self._batch[1] or 0
        self._since["wait"] += wait_s

    def set_batch_tokens(self, tokens: int) -> None:
        self._since["tokens"] += int(tokens) - (self._batch[1] or 0)
        self._batch = (self._batch[0], int(tokens))

    def count(self, part: str) -> Any:
        """A context that counts the FLOPs run inside it into this meter's one measurement:
        ``part`` "forward" (the first training forward), then "backward" (the backward after it);
        a no-op for a part already counted, or a backward with no counted forward before it."""
        import contextlib

        wanted = not self.forward_counted if part == "forward" else (self.forward_counted and self.flops_per_unit is None)
        return _Counting(self) if wanted else contextlib.nullcontext()

    @property
    def forward_counted(self) -> bool:
        return self._forward is not None

    def counted(self, flops: float, ops: dict[str, float]) -> None:
        """One span's count (``count``): the forward's, then the backward's, which completes it."""
        if self._forward is None:
            self._forward = (flops, ops)
            return
        total = self._forward[0] + flops
        ops = {op: self._forward[1].get(op, 0) + ops.get(op, 0) for op in {*self._forward[1], *ops}}
        units = self._batch[1] or self._batch[0]
        if not units:
            return
        if self._batch[1] and total / units < 2 * self.parameters:
            # Fewer FLOPs per token than the forward alone takes: the GEMMs ran as kernels torch's
            # counter does not see (Transformer Engine's and MS-AMP's own). Say so, report no FLOPs.
            from lowbit.notices import note

            note("throughput: the backend's GEMMs are kernels torch's FlopCounterMode does not see, so TFLOP/s and "
                 "MFU are left out of the figures (tokens/s and samples/s are measured as ever).")
            self.flops_per_unit = 0.0
            return
        self.flops_per_unit = total / units
        gemm = sum(n for op, n in ops.items() if any(k in op for k in ("mm", "matmul", "linear")))
        self.fp8_gemm_share = (sum(n for op, n in ops.items() if "_scaled_mm" in op) / gemm) if gemm else None

    def on_step(self) -> None:
        now = time.perf_counter()
        seconds = max(now - self._last_step, 1e-9)
        since, self._last_step = self._since, now
        self._since = {"samples": 0, "tokens": 0, "wait": 0.0}
        self.steps += 1
        figures = {"throughput/step_s": seconds}
        if since["samples"]:  # batches came from a prepared dataloader (a script may feed tensors itself)
            figures["throughput/samples_per_s"] = since["samples"] / seconds
            figures["throughput/data_wait_share"] = min(since["wait"] / seconds, 1.0)
        if since["tokens"]:
            figures["throughput/tokens_per_s_per_device"] = since["tokens"] / seconds
            figures["throughput/tokens_per_s"] = since["tokens"] / seconds * self.num_processes
        units = since["tokens"] or since["samples"]
        if self.flops_per_unit and units:
            tflops = self.flops_per_unit * units / seconds / 1e12
            figures["throughput/tflops_per_device"] = tflops
            figures["throughput/mfu"] = tflops / self.peak().tflops
        if self.fp8_gemm_share is not None and self.precision not in ("no", "fp16", "bf16"):
            figures["throughput/fp8_gemm_share"] = self.fp8_gemm_share
        figures["throughput/peak_memory_mb"] = self._peak_memory_mb()
        self.latest = figures
        if self.is_main and self.every_s > 0 and now - self._last_said >= self.every_s:
            self._last_said = now
            self.say(self.progress_line())

    # ------------------------------------------------------------------ what it says

    def peak(self) -> DevicePeak:
        if self._peak is None:
            if self.device.type == "cuda":
                name = torch.cuda.get_device_name(self.device)
                self._peak = gpu_peak(name) or DevicePeak(name, float("nan"), None, "not in lowbit's table")
            else:  # FP8 on a CPU is emulated inside bf16 autocast: its GEMMs run in bf16
                self._peak = cpu_peak(torch.float32 if self.precision == "no" else torch.bfloat16)
        return self._peak

    def progress_line(self) -> str:
        f = self.latest
        parts = [f"step {self.steps}"]
        if "throughput/tokens_per_s" in f:
            parts.append(f"{f['throughput/tokens_per_s']:,.0f} tokens/s ({f['throughput/tokens_per_s_per_device']:,.0f}/device)")
        parts.append(f"{1 / f['throughput/step_s']:,.2f} steps/s")
        if "throughput/samples_per_s" in f:
            parts.append(f"{f['throughput/samples_per_s']:,.1f} samples/s")
        if "throughput/tflops_per_device" in f:
            share = (f", {100 * f['throughput/fp8_gemm_share']:.0f}% of GEMM FLOPs in FP8"
                     if "throughput/fp8_gemm_share" in f else "")
            parts.append(f"{_flops(f['throughput/tflops_per_device'])}/device, MFU {100 * f['throughput/mfu']:.1f}% "
                         f"of {self.peak().name}'s {_flops(self.peak().tflops)}{share}")
        if "throughput/data_wait_share" in f:
            parts.append(f"data wait {100 * f['throughput/data_wait_share']:.0f}%")
        parts.append(f"peak memory {f['throughput/peak_memory_mb']:,.0f} MB")
        return "lowbit: " + " | ".join(parts)

    def _peak_memory_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's peak RSS (KiB on Linux)


class _Counting:
    """One FlopCounterMode span (entered and left by the caller: a hook pair, or a with block)."""

    def __init__(self, meter: ThroughputMeter):
        from torch.utils.flop_counter import FlopCounterMode

        self.meter, self.mode = meter, FlopCounterMode(display=False)

    def __enter__(self) -> "_Counting":
        self.mode.__enter__()
        return self

    def __exit__(self, *error: Any) -> None:
        self.mode.__exit__(*error)
        if error[0] is None:
            ops = {str(op): n for op, n in self.mode.get_flop_counts().get("Global", {}).items()}
            self.meter.counted(self.mode.get_total_flops(), ops)


def _flops(tflops: float) -> str:
    return f"{tflops:,.1f} TFLOP/s" if tflops >= 1 else f"{1000 * tflops:,.1f} GFLOP/s"


def meter_is_on() -> bool:
    return os.environ.get(OFF_ENV, "1").strip().lower() not in ("0", "false", "off", "no")
