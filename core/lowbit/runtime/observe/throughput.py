"""How fast a run trains, measured while it trains, with no code in the script.

Tokens and samples are counted from the batches the prepared dataloaders hand out (``input_ids``,
else the first 2-D integer tensor; ``accelerator.set_batch_tokens(n)`` tells another count), the
time between optimizer steps (on a GPU, the device's, from events read once it finished them; on
a CPU, the clock), and the model's FLOPs once, after the first optimizer step and outside it:
one forward of the prepared model traced on meta stand-ins at the first batch's shapes, by the
work counter ``lowbit fp8-payoff`` uses (:func:`~lowbit.runtime.observe.fp8_payoff.trace_work`),
never inside the user's forward or a compiled region. A training step counts three times the
forward's GEMM and attention FLOPs (forward, grad-input, grad-weight). MFU is against the device's
dense bf16 peak (``GPU_PEAKS``, each with its source; on a CPU a GEMM peak measured once and
cached), also for FP8 runs, whose share of GEMM FLOPs in layers the backend converted is said
beside it: one peak does not describe a mixed run. Nothing here reads the device (no host sync).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from lowbit.kernel.env_numbers import env_number, env_switch

from lowbit.runtime.nests import tensor_leaves
from lowbit.runtime.observe.gpu_specs import DevicePeak, gpu_peak
from lowbit.runtime.precision import Precision

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


def _cpu_peak_cache(cache: Path | None) -> Path:
    return cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowbit" / "cpu_peak.json"


def _cpu_peak_key(dtype: torch.dtype) -> str:
    return f"{_cpu_model()}|{torch.get_num_threads()} threads|torch {torch.__version__}|{dtype}"


def cpu_peak(dtype: torch.dtype, cache: Path | None = None) -> DevicePeak:
    """This CPU's GEMM rate in ``dtype`` (TFLOP/s, best of a few 1024x1024 matmuls on the threads
    torch uses), per CPU model, thread count and torch version: measured at each run, the best rate
    ever seen kept in a cache (one measured while the machine was busy is not the peak for good)."""
    cache = _cpu_peak_cache(cache)
    own = torch.Generator().manual_seed(0)  # the run's random streams are not drawn from
    a, b = (torch.randn(1024, 1024, dtype=dtype, generator=own) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    tflops = raise_cpu_peak(dtype, 2 * 1024**3 / best / 1e12, cache)
    name = f"{_cpu_model()} ({str(dtype).removeprefix('torch.')} GEMM, measured)"
    return DevicePeak(name, tflops, None, f"the best rate measured here, cached in {cache}")


def raise_cpu_peak(dtype: torch.dtype, tflops: float, cache: Path | None = None) -> float:
    """Keep ``tflops`` as this CPU's peak in ``dtype`` if it beats the cached one; the peak now."""
    cache, key = _cpu_peak_cache(cache), _cpu_peak_key(dtype)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if tflops > known.get(key, 0.0):
        known[key] = tflops
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known, indent=1))
        except OSError:
            pass  # read-only home: this run's measurement only
    return known[key]


def batch_counts(batch: Any, tensors: list[torch.Tensor] | None = None) -> tuple[int, int | None]:
    """Samples (the first tensor's first dimension) and tokens (``input_ids``' elements, else the
    first 2-D integer tensor's) of a batch; tokens None when there is no such tensor. ``tensors``:
    the batch's tensors in order, when the caller walked it already."""
    tensors = list(tensor_leaves(batch)) if tensors is None else tensors
    if not tensors:
        return 0, None
    samples = int(tensors[0].shape[0]) if tensors[0].dim() else 1
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    if not isinstance(ids, torch.Tensor):
        ids = next((t for t in tensors if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()), None)
    return samples, (int(ids.numel()) if ids is not None else None)


class ThroughputMeter:
    """Counts a run's work between optimizer steps; ``latest`` holds the stable-named figures of
    the last step (``throughput/...``), printed every ``every_s`` seconds on the main process.
    ``num_processes``: how many processes read different batches (data parallel; tensor-parallel
    ranks share theirs)."""

    def __init__(
        self,
        device: torch.device,
        num_processes: int,
        precision: Precision,
        is_main: bool,
        say: Callable[[str], None] = print,
        model_parallel: int = 1,
    ):
        self.device, self.num_processes, self.precision, self.is_main, self.say = (
            device,
            num_processes,
            precision,
            is_main,
            say,
        )
        self.model_parallel = model_parallel  # processes sharing one batch's work (tensor/context parallel)
        self.every_s = env_number(EVERY_ENV, DEFAULT_EVERY_S, meaning="seconds between progress lines; 0: none")
        self._last: tuple[float, dict[str, float]] | None = None  # the last step's seconds and counts
        self.flops_per_unit: float | None = None  # per token, or per sample when batches have no tokens
        self.fp8_gemm_share: float | None = None
        self.steps = 0
        self._peak: DevicePeak | None = None
        self._peak_said = False  # the note that no honest peak is known, said once
        self._model: Any = None  # the meta copy whose FLOPs are counted (an exception: it could not be made)
        self._low_precision_layers: set[str] = set()
        self._first_batch: Any = None  # meta stand-ins of the first batch, until the count
        self.saw_batches = False  # a prepared dataloader handed out a batch (Ray Data's iterators do not)
        self._loader_counted = False  # the current batch's tokens were counted from the loader's batch
        self.counted_as: str | None = None  # how the batch was fed to the counted forward
        self._batch: tuple[int, int | None] = (0, None)
        self._since: dict[str, float] = {"samples": 0, "tokens": 0, "wait": 0.0}
        self._last_step = self._last_said = time.perf_counter()
        # On a GPU, an event recorded at each step's end, with the step's counts: the step's seconds are
        # the device's, read from the newest pair of steps the GPU has finished (event.query(): no sync).
        # The host clock alone measures when the CPU queued work, right only when something synced.
        self._marks: collections.deque = collections.deque(maxlen=16)

    # ------------------------------------------------------------------ what the run tells it

    def copy_structure(self, model: torch.nn.Module) -> None:
        """At prepare(), before the backend converts ``model`` and the strategy spreads it: a meta
        copy of its structure (no memory) is what the count traces, after the first step. A model
        that cannot be copied is counted never (one note then)."""
        if self._model is not None:
            return
        from lowbit.runtime.observe.fp8_payoff import meta_copy

        try:
            self._model = meta_copy(model)
        except Exception as exc:  # noqa: BLE001 - an instrument never breaks the run
            self._model = exc

    def converted(self, low_precision_layers: Iterable[str]) -> None:
        """The layers the backend converted (names in the model as prepare() got it): their GEMMs count as FP8."""
        self._low_precision_layers = set(low_precision_layers)

    def on_batch(self, batch: Any, wait_s: float, tensors: list[torch.Tensor] | None = None) -> None:
        if self._first_batch is not None and self.steps:
            # once, at the first batch after the first optimizer step: in the loader, never inside a
            # step the user may have compiled (torch.compile(optimizer.step)), which the count's eager
            # trace cannot run in
            self.count_flops()
        self._batch = batch_counts(batch, tensors)
        self.saw_batches = self._loader_counted = True
        self._since["samples"] += self._batch[0]
        self._since["tokens"] += self._batch[1] or 0
        self._since["wait"] += wait_s
        if self._first_batch is None and self.flops_per_unit is None:
            self._first_batch = (_meta_tree(batch), self._batch)

    def _say_no_batches(self) -> None:
        from lowbit.kernel.notices import note

        note(
            "throughput: no batch came through a prepared dataloader (Ray Data's iterators, or a loop that feeds "
            "tensors itself), so steps/s is measured but samples/s, tokens/s, TFLOP/s and MFU are not; "
            "accelerator.set_batch_tokens(n) after each batch counts tokens, and a NaN step's batch is not replayed."
        )

    def set_batch_tokens(self, tokens: int) -> None:
        """The tokens of the batch just taken: they replace what the prepared loader counted for it,
        or, for a batch that came another way (a loop feeding tensors itself), they are added."""
        counted = self._batch[1] or 0 if self._loader_counted else 0
        self._since["tokens"] += int(tokens) - counted
        self._batch, self._loader_counted = (self._batch[0], int(tokens)), False

    def count_flops(self) -> None:
        """The one FLOP count (at the batch after the first step): the watched model's forward traced
        on the first batch's shapes. A count that fails, or that could be wrong (a value read on the
        host sizes the work, a custom op's work is unseen), leaves TFLOP/s and MFU out, with one note."""
        if self._model is None or self._first_batch is None or self.flops_per_unit is not None:
            return
        model, self._model = self._model, None  # counted once; the copy is not kept
        (batch, (samples, tokens)), self._first_batch = self._first_batch, None
        self.flops_per_unit = 0.0  # until counted: a failed count is not tried again
        try:
            if isinstance(model, Exception):
                raise model
            # The copy's forward runs the model's own Python code once more, on meta tensors: its
            # prints would show values the run never computed, so they go nowhere.
            with random_state_kept(self.device), _prints_silenced():
                work, call = _trace_first_batch(model, batch)
        except Exception as exc:  # noqa: BLE001 - an instrument never breaks the run
            from lowbit.kernel.notices import note

            why = (
                "its structure could not be copied to trace (no memory) at prepare()"
                if exc is model
                else f"its forward did not run on the first batch's shapes ({_calls_tried(batch)})"
            )
            note(
                f"throughput: the model's FLOPs were not counted, so TFLOP/s and MFU are left out (tokens/s and "
                f"samples/s are measured as ever): {why}: {type(exc).__name__}: {str(exc)[:200]}"
            )
            return
        units = tokens or samples
        # A step's GEMM FLOPs per layer, every call summed (a block shared across depth runs each time):
        # forward, grad-input and grad-weight; a frozen layer (LoRA's base) has no grad-weight GEMM.
        linear: dict[str, float] = {}
        for layer in work.linears:
            passes = 2 if layer.frozen else 3
            flops = passes * 2 * layer.tokens * layer.in_features * layer.out_features
            linear[layer.name] = linear.get(layer.name, 0) + flops
        gemm = sum(linear.values()) + 3 * (work.other_gemm_flops + work.attention_flops)
        if not units or not gemm:
            return
        self.flops_per_unit = gemm / units / self.model_parallel  # a batch's work split over model-parallel ranks
        low = sum(flops for name, flops in linear.items() if name in self._low_precision_layers)
        self.fp8_gemm_share = low / gemm
        self.counted_as = call  # how the batch was fed to the counted forward

    def on_step(self) -> None:
        now = time.perf_counter()
        seconds = max(now - self._last_step, 1e-9)
        since, self._last_step = self._since, now
        self._since = {"samples": 0, "tokens": 0, "wait": 0.0}
        self.steps += 1
        self._last = (seconds, since)  # the figures are worked out when read, not every step
        if self.steps == 2 and not self.saw_batches and not since["tokens"]:
            self._say_no_batches()
        if self.device.type == "cuda":
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            self._marks.append((mark, since))
        if self.is_main and self.every_s > 0 and now - self._last_said >= self.every_s:
            self._last_said = now
            self.say(self.progress_line())

    @property
    def latest(self) -> dict[str, float]:
        """The last optimizer step's figures (empty before the first step)."""
        if self._last is None:
            return {}
        seconds, since = self._device_timed() or self._last
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
            if tflops <= self.peak().tflops:
                figures["throughput/mfu"] = tflops / self.peak().tflops
            else:
                self._no_honest_peak(tflops)
        if self.fp8_gemm_share is not None and self.precision.served_by_backend:
            figures["throughput/fp8_gemm_share"] = self.fp8_gemm_share
        figures["throughput/peak_memory_mb"] = self._peak_memory_mb()
        return figures

    def _device_timed(self) -> tuple[float, dict[str, float]] | None:
        """The newest step the GPU has finished: its seconds between step-end events, and its counts."""
        marks = list(self._marks)
        for index in range(len(marks) - 1, 0, -1):
            if marks[index][0].query():
                return max(marks[index - 1][0].elapsed_time(marks[index][0]) / 1000, 1e-9), marks[index][1]
        return None

    # ------------------------------------------------------------------ what it says

    def peak(self) -> DevicePeak:
        if self._peak is None:
            if self.device.type == "cuda":
                name = torch.cuda.get_device_name(self.device)
                self._peak = gpu_peak(name) or DevicePeak(name, float("nan"), None, "not in lowbit's table")
            else:  # FP8 on a CPU is emulated inside bf16 autocast: its GEMMs run in bf16
                # the compute dtype of the run's GEMMs (FP8 on a CPU is emulated inside bf16 autocast)
                self._peak = cpu_peak(self.precision.autocast_dtype or torch.float32)
        return self._peak

    def _no_honest_peak(self, tflops: float) -> None:
        """A step ran faster than the peak: the peak is wrong (a CPU measured while busy, or on a
        slower path than the model's GEMMs), so no MFU is given (never one above 100%); on a CPU
        the rate becomes the cached peak for the next runs."""
        if self._peak_said:
            return
        self._peak_said = True
        from lowbit.kernel.notices import note

        peak = self.peak()
        then = ""
        if self.device.type == "cpu":
            raise_cpu_peak(self.precision.autocast_dtype or torch.float32, tflops)
            then = "; this rate is now the cached peak, so later runs measure MFU against it"
        note(
            f"throughput: MFU is left out: this model ran at {_flops(tflops)}, above {peak.name}'s "
            f"{_flops(peak.tflops)} ({peak.source}), so that peak is not an honest one{then}."
        )

    def progress_line(self) -> str:
        f = self.latest
        parts = [f"step {self.steps}"]
        if "throughput/tokens_per_s" in f:
            parts.append(
                f"{f['throughput/tokens_per_s']:,.0f} tokens/s ({f['throughput/tokens_per_s_per_device']:,.0f}/device)"
            )
        parts.append(f"{1 / f['throughput/step_s']:,.2f} steps/s")
        if "throughput/samples_per_s" in f:
            parts.append(f"{f['throughput/samples_per_s']:,.1f} samples/s")
        if "throughput/tflops_per_device" in f:
            share = (
                f", {100 * f['throughput/fp8_gemm_share']:.0f}% of GEMM FLOPs in FP8"
                if "throughput/fp8_gemm_share" in f
                else ""
            )
            utilisation = (
                f"MFU {100 * f['throughput/mfu']:.1f}% of {self.peak().name}'s {_flops(self.peak().tflops)}"
                if "throughput/mfu" in f
                else "no MFU (no honest peak: see the note)"
            )
            parts.append(f"{_flops(f['throughput/tflops_per_device'])}/device, {utilisation}{share}")
        if "throughput/data_wait_share" in f:
            parts.append(f"data wait {100 * f['throughput/data_wait_share']:.0f}%")
        parts.append(f"peak memory {f['throughput/peak_memory_mb']:,.0f} MB")
        return "lowbit: " + " | ".join(parts)

    def _peak_memory_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's peak RSS (KiB on Linux)


def _meta_tree(data: Any) -> Any:
    """``data`` with each tensor replaced by a meta tensor of its shape and dtype (no copy, no sync)."""
    if isinstance(data, torch.Tensor):
        return torch.empty(data.shape, dtype=data.dtype, device="meta")
    if isinstance(data, dict) or hasattr(data, "keys") and hasattr(data, "values") and hasattr(data, "items"):
        return {key: _meta_tree(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_meta_tree(value) for value in data]
    return data


def feeding_calls(batch: Any) -> list[tuple[str, tuple, dict]]:
    """The ways a training loop usually feeds a batch to the model, most likely first."""
    if isinstance(batch, dict):
        tensors = [(key, value) for key, value in batch.items() if isinstance(value, torch.Tensor)]
        return [("model(**batch)", (), batch)] + [(f"model(batch[{key!r}])", (value,), {}) for key, value in tensors]
    if isinstance(batch, list):
        return [("model(batch[0])", (batch[0],), {}), ("model(*batch)", tuple(batch), {})] if batch else []
    return [("model(batch)", (batch,), {})]


def _calls_tried(batch: Any) -> str:
    return ", ".join(name for name, _, _ in feeding_calls(batch)) or "an empty batch"


def _trace_first_batch(model: torch.nn.Module, batch: Any) -> tuple[Any, str]:
    """The work of the first call convention that runs, and which one; the first one's error if none does."""
    from lowbit.runtime.observe.fp8_payoff import trace_work

    first_error: Exception | None = None
    for name, args, kwargs in feeding_calls(batch):
        try:
            return trace_work(model, args, kwargs), name
        except Exception as exc:  # noqa: BLE001 - try the next convention
            first_error = first_error or exc
    raise first_error or ValueError("the batch holds no tensor")


@contextlib.contextmanager
def _prints_silenced():
    with open(os.devnull, "w") as nowhere, contextlib.redirect_stdout(nowhere), contextlib.redirect_stderr(nowhere):
        yield


@contextlib.contextmanager
def random_state_kept(device: torch.device):
    """Every random stream the user's run draws from, as it was before: torch's CPU generator and the
    device's, Python's ``random`` and NumPy's global one. The count's forward may draw (dropout, layer
    drop, stochastic depth); the run must train as it would with the meter off."""
    import random

    numpy = sys.modules.get("numpy")  # only if the run imported it
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy_state is not None:
                numpy.random.set_state(numpy_state)


def _flops(tflops: float) -> str:
    return f"{tflops:,.1f} TFLOP/s" if tflops >= 1 else f"{1000 * tflops:,.1f} GFLOP/s"


def meter_is_on() -> bool:
    return env_switch(OFF_ENV, True)
