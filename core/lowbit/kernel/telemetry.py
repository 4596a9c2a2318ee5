"""FP8 numerics telemetry: per layer and step, the amax and scale of what gets cast to FP8, and
the fraction of values that saturate (beyond the format's max) or flush to zero.

Backends decide which tensors are cast and with which scale (their hook
``enable_fp8_telemetry``); the arithmetic and the warning live here, once, for all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from lowbit.kernel.notices import LowbitWarning, warn

if TYPE_CHECKING:
    import torch


@dataclass
class TensorStats:
    amax: float
    scale: float  # the per-tensor scale, or the smallest one for row-wise scaling
    saturated: float  # fraction of values with |x * scale| beyond the FP8 max
    flushed: float  # fraction of non-zero values that become zero in FP8
    # Block-scaled formats (MXFP8, NVFP4): the fraction of blocks whose scale saturates (beyond the
    # scale format's largest value: its values clip) or underflows (a non-zero block whose scale is
    # below the smallest one: its values flush to zero). None for per-tensor and per-row scales.
    blocks_saturated: float | None = None
    blocks_underflow: float | None = None


@dataclass
class LayerStats:
    layer: str
    step: int
    tensors: dict[str, TensorStats] = field(default_factory=dict)  # "input", "weight", "grad_output"


class SaturationWarning(LowbitWarning):
    """A tensor's FP8 saturation fraction passed the configured threshold."""


class UnderflowWarning(LowbitWarning):
    """The fraction of a tensor's non-zero values that its FP8 cast flushes to zero passed the threshold."""


def cast_stats(x: "torch.Tensor", fp8_dtype: "torch.dtype", scale: "torch.Tensor") -> "PendingStats":
    """What casting ``x * scale`` to ``fp8_dtype`` does to ``x`` (``scale`` broadcasts: scalar or
    row-wise), computed on ``x``'s device and read later (no host sync here)."""
    import torch

    x = x.detach().float()
    scaled = x * scale.float()
    info = torch.finfo(fp8_dtype)
    fp8_max = info.max
    # A value saturates when it would round to something above the largest finite FP8 number:
    # beyond max + half the spacing of the top binade. Values just above max by a float ulp of
    # the scale computation round to max and are not counted.
    top_spacing = 2.0 ** math.floor(math.log2(fp8_max)) * info.eps
    saturated = (scaled.abs() > fp8_max + top_spacing / 2).float().mean()
    quantized = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype).float()
    nonzero = x != 0
    flushed = ((quantized == 0) & nonzero).float().sum() / max(x.numel(), 1)
    return PendingStats(torch.stack([x.abs().max(), scale.float().min(), saturated, flushed]))


def block_cast_stats(
    x: "torch.Tensor",
    block: int,
    wanted_scale: "Callable[[torch.Tensor], torch.Tensor]",
    smallest: float,
    largest: float,
) -> "PendingStats":
    """What a block-scaled cast does to ``x`` (blocks of ``block`` along its last dim), computed on
    ``x``'s device and read later.

    ``wanted_scale`` maps each block's amax to the scale the format would store for it, before
    it is clamped to the scale format's range [``smallest``, ``largest``]. A block beyond it
    saturates (its values clip), a non-zero block below it underflows (its values flush)."""
    import torch

    x = x.detach().float().reshape(-1, x.shape[-1])
    blocks = x.reshape(x.shape[0], -1, block)
    block_amax = blocks.abs().amax(dim=-1)
    wanted = wanted_scale(block_amax)
    saturated_blocks = wanted > largest
    underflow_blocks = (block_amax > 0) & (wanted < smallest)
    count = max(block_amax.numel(), 1)
    nonzero = (blocks != 0).float()
    smallest_used = torch.where(block_amax > 0, wanted, torch.full_like(wanted, float("inf"))).min()
    return PendingStats(
        torch.stack(
            [
                x.abs().max(),
                torch.where(torch.isfinite(smallest_used), smallest_used, torch.zeros_like(smallest_used)),
                saturated_blocks.float().sum() * block / max(x.numel(), 1),
                (nonzero * underflow_blocks.unsqueeze(-1)).sum() / max(x.numel(), 1),
                saturated_blocks.float().sum() / count,
                underflow_blocks.float().sum() / count,
            ]
        ),
        blocks=True,
    )


@dataclass
class PendingStats:
    """A cast's figures still on the device (amax, scale, saturated, flushed[, blocks saturated,
    blocks underflow]): read with the step's others, in one host read."""

    figures: "torch.Tensor"
    blocks: bool = False

    def read(self, values: list[float] | None = None) -> TensorStats:
        values = self.figures.tolist() if values is None else values
        return TensorStats(*values[:4], *(values[4:6] if self.blocks else ()))


class TelemetryRecorder:
    """Handed to the backend's ``enable_fp8_telemetry`` hook; the backend calls ``record``."""

    def __init__(self, every_n_steps: int = 1, saturation_warning: float = 0.001, underflow_warning: float = 0.01):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.saturation_warning = saturation_warning
        self.underflow_warning = underflow_warning
        self.step = 0
        # Whether this step is sampled (backends skip the work otherwise): a bool set between steps,
        # not worked out from ``step`` in the hooks, so that under torch.compile the hooks' guard is on
        # this flag (two graphs at most: sampled and not) rather than on the step count (a recompile
        # every step).
        self.active = True
        self.layers: dict[str, LayerStats] = {}
        self.removers: list[Any] = []
        self._pending: list[tuple[str, str, PendingStats]] = []  # this step's figures, read together

    def record(self, layer: str, role: str, x: "torch.Tensor", fp8_dtype: "torch.dtype", scale: "torch.Tensor") -> None:
        if self.active:
            self.record_stats(layer, role, cast_stats(x, fp8_dtype, scale))

    def record_stats(self, layer: str, role: str, stats: "TensorStats | PendingStats") -> None:
        """Keep ``stats`` (from ``cast_stats`` or ``block_cast_stats``) for this step; figures still
        on the device are read, all together, when the step ends (``next_step``) or when asked."""
        if not self.active:
            return
        if isinstance(stats, PendingStats):
            self._pending.append((layer, role, stats))
            return
        self._keep(layer, role, stats)

    def read_pending(self) -> None:
        """Read this step's figures from the device: one host read for all of them."""
        if not self._pending:
            return
        import torch

        pending, self._pending = self._pending, []
        flat = torch.cat([stats.figures.reshape(-1).float() for _, _, stats in pending]).tolist()
        at = 0
        for layer, role, stats in pending:
            width = stats.figures.numel()
            self._keep(layer, role, stats.read(flat[at : at + width]))
            at += width

    def _keep(self, layer: str, role: str, stats: TensorStats) -> None:
        entry = self.layers.setdefault(layer, LayerStats(layer, self.step))
        if entry.step != self.step:
            entry.step, entry.tensors = self.step, {}
        entry.tensors[role] = stats
        if not math.isfinite(stats.amax):
            warn(
                f"FP8 telemetry: {layer}'s {role} holds NaN or inf at step {self.step} (amax {stats.amax}); "
                "the casts of this tensor are meaningless. See docs/troubleshooting.md, 'loss diverges under fp8'.",
                SaturationWarning,
            )
        elif stats.saturated > self.saturation_warning:
            warn(
                f"FP8 saturation: {stats.saturated:.2%} of {layer}'s {role} exceeds the format's range "
                f"at step {self.step} "
                f"(threshold {self.saturation_warning:.2%}). See docs/troubleshooting.md, 'loss diverges under fp8'.",
                SaturationWarning,
            )
        if math.isfinite(stats.amax) and stats.flushed > self.underflow_warning:
            warn(
                f"FP8 underflow: {stats.flushed:.2%} of {layer}'s {role} flushes to zero at step {self.step} "
                f"(threshold {self.underflow_warning:.2%}): its values span more than the format's range below "
                f"amax {stats.amax:.3g}. Keep the layer in high precision (module_filter_func) or use a recipe with "
                "finer scales (rowwise, mxfp8). See docs/troubleshooting.md, 'loss diverges under fp8'.",
                UnderflowWarning,
            )

    def next_step(self) -> None:
        self.read_pending()
        self.step += 1
        self.active = self.step % self.every_n_steps == 0

    def remove(self) -> None:
        for remover in self.removers:
            remover.remove()
        self.removers.clear()


class FP8StatsTable(list):
    """``accelerator.fp8_stats()``: a list of LayerStats that prints as a table."""

    def __str__(self) -> str:
        blocks = any(s.blocks_saturated is not None for layer in self for s in layer.tensors.values())
        header = (
            f"{'layer':<24} {'tensor':<12} {'step':>5} {'amax':>10} {'scale':>10} {'saturated':>10} {'flushed':>10}"
        )
        header += f" {'blk sat':>8} {'blk under':>9}" if blocks else ""
        lines = [header, "-" * len(header)]
        for layer in self:
            for role, s in layer.tensors.items():
                line = (
                    f"{layer.layer:<24} {role:<12} {layer.step:>5} {s.amax:>10.4g} {s.scale:>10.4g} "
                    f"{s.saturated:>10.2%} {s.flushed:>10.2%}"
                )
                if s.blocks_saturated is not None:
                    line += f" {s.blocks_saturated:>8.2%} {s.blocks_underflow:>9.2%}"
                lines.append(line)
        return "\n".join(lines)
