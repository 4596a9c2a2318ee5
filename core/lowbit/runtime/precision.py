"""What one run's ``mixed_precision`` means, answered in one place.

Lightning Fabric's ``Precision`` is the anchor: the autocast dtype of the forward, loss scaling in
backward, unscaling before clipping, the optimizer step (skipped when fp16 overflowed), the
scaler's state in checkpoints, and whether this machine runs the precision slowly. The run
(:mod:`lowbit.run.training_run`) builds one :class:`Precision`; its ``backward`` and ``clip_grad_norm_``, the prepared
optimizer's ``step`` and the checkpointer call it, and ``PrepareContext.autocast_dtype`` carries
its dtype to the plugins. It builds the forward's ``torch.autocast`` once, at ``prepare()``
(``autocast_factory``, honouring ``AutocastKwargs``). A low-precision backend ("fp8", "fp4", or a
third party's name) composes with it: its GEMMs run inside the bf16 autocast, its own context
inside that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from lowbit.kernel.cpu_features import cpu_has_native_bf16
from lowbit.kernel.notices import LowbitNote, warn
from lowbit.kernel.types import NATIVE_PRECISIONS


class SlowPrecisionNotice(LowbitNote):
    """The precision asked for is slow on this device (said once per run, on the main process)."""


# fp16's loss scaler halves the scale at each skipped step: this many skipped in a row (the scale
# 256x lower) means the model overflows fp16 every step rather than now and then. Said at 8, 16, 32, ...
FP16_SKIP_RUN = 8


@dataclass
class Precision:
    """One run's precision: ``name`` is "no", "fp16", "bf16", or a low-precision backend's ("fp8", "fp4", ...).

    ``scaler`` is torch's GradScaler under fp16, unless the strategy scales the loss itself
    (DeepSpeed); None otherwise."""

    name: str
    device: torch.device
    scaler: torch.amp.GradScaler | None = None
    # The optimizers whose gradients were unscaled this step (clip_grad_norm_ before step).
    _unscaled: set[int] = field(default_factory=set, repr=False)
    consecutive_skips: int = 0  # fp16 steps skipped in a row, up to the last one
    _watched: set[int] = field(default_factory=set, repr=False)  # optimizers with the step post-hook
    # Each watched optimizer's last step: True (it ran), or the scaler's device verdict a fused
    # optimizer was handed (it ran, and skipped its update on the device if the verdict says so).
    _stepped: dict[int, Any] = field(default_factory=dict, repr=False)
    # Fused steps' verdicts not yet counted in consecutive_skips: read at the next step, when the
    # device has long finished them (no host sync at the step that queued them).
    _uncounted: list["DeviceVerdict"] = field(default_factory=list, repr=False)
    # fp16: the scale is updated once per iteration, after every optimizer of the run stepped
    # (updating after each would unscale the next one's gradients twice and move the scale N times).
    optimizers_per_step: int = 1
    _stepped_since_update: set[int] = field(default_factory=set, repr=False)
    # AutocastKwargs' settings (Accelerate's handler): enabled, cache_enabled.
    autocast_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_run(
        cls,
        name: str,
        device: torch.device,
        strategy_scales_loss: bool = False,
        scaler_kwargs: dict[str, Any] | None = None,
        autocast_kwargs: dict[str, Any] | None = None,
    ) -> "Precision":
        scaler = (
            torch.amp.GradScaler(device.type, **(scaler_kwargs or {}))
            if name == "fp16" and not strategy_scales_loss
            else None
        )
        return cls(name, device, scaler, autocast_kwargs=dict(autocast_kwargs or {}))

    def autocast_factory(self, autocast_kwargs: dict[str, Any] | None = None) -> Callable[[], ContextManager] | None:
        """The forward's autocast as a function returning a fresh ``torch.autocast`` each call, its
        arguments decided now (None: fp32, no autocast). ``autocast_kwargs`` (an ``AutocastKwargs``'
        settings) override the run's, as ``accelerator.autocast(autocast_handler=...)`` does."""
        if self.autocast_dtype is None:
            return None
        given = {
            k: v
            for k, v in (self.autocast_kwargs if autocast_kwargs is None else autocast_kwargs).items()
            if v is not None
        }
        return functools.partial(torch.autocast, device_type=self.device.type, dtype=self.autocast_dtype, **given)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The native autocast dtype of the forward: none for fp32, fp16 for fp16, and bf16 for
        bf16 and every low-precision backend's precision (their FP8/FP4 GEMMs run inside it)."""
        if self.name == "no":
            return None
        return torch.float16 if self.name == "fp16" else torch.bfloat16

    @property
    def served_by_backend(self) -> bool:
        """Whether a low-precision backend trains in it (fp8, fp4, ...), not torch's autocast alone."""
        return self.name not in NATIVE_PRECISIONS

    @property
    def skips_nonfinite_steps(self) -> bool:
        """fp16's loss scaler skips a step whose gradients hold inf/nan by itself."""
        return self.scaler is not None

    def slow_reason(self) -> str | None:
        """Why this precision runs slowly on this device, or None. CPUs without native bf16
        (AVX512-BF16 or AMX) run bf16 matmuls on a slow path (measured 57x slower than fp32 on an
        AMD EPYC with AVX2 only), and every precision whose forward autocasts to bf16 pays it. GPUs
        before Ampere (sm_80: T4, V100) have no bf16 tensor cores: torch emulates bf16 there."""
        if self.device.type == "cuda":
            return self._slow_on_gpu()
        if self.device.type != "cpu":
            return None
        if self.name == "fp16":
            return (
                "fp16 on a CPU usually runs much slower than fp32 (torch's CPU autocast has no fast fp16 matmuls on "
                "most CPUs); bf16 is the low-precision choice on CPUs that have native bf16."
            )
        # a torch without the feature probes is taken to have native bf16 (no notice)
        if self.autocast_dtype == torch.bfloat16 and not cpu_has_native_bf16(when_unknown=True):
            inside = f" ({self.name} runs inside bf16 autocast)" if self.served_by_backend else ""
            return (
                f"This CPU has no native bf16 (no AVX512-BF16 or AMX; torch reports "
                f"{torch.backends.cpu.get_cpu_capability()}), so {self.name}{inside} runs much slower than fp32 "
                "here; numerics are unaffected."
            )
        return None

    def _slow_on_gpu(self) -> str | None:
        if self.autocast_dtype != torch.bfloat16:
            return None
        major, minor = torch.cuda.get_device_capability(self.device)
        if major >= 8:
            return None
        inside = f" ({self.name} runs inside bf16 autocast)" if self.served_by_backend else ""
        return (
            f"This GPU ({torch.cuda.get_device_name(self.device)}, sm_{major}{minor}) has no bf16 tensor cores "
            f"(they came with sm_80, Ampere), so {self.name}{inside} is emulated and runs slower than fp32 here; "
            "fp16 (mixed_precision='fp16', with its loss scaling) is the fast half precision on this GPU."
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, the loss scaled first under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring fp16-scaled gradients back to their true size (before clipping), once per step."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None
    ) -> tuple[Any, "bool | DeviceVerdict"]:
        """Step ``optimizer``; returns (its result, whether the step was skipped). Under fp16 the
        scaler skips a step with inf/nan gradients, and lowers the scale exactly then. A fused
        optimizer (``AdamW(fused=True)``) skips on the device: its verdict is a :class:`DeviceVerdict`,
        read when asked, so the step adds no host sync."""
        if self.scaler is None:
            return (optimizer.step(closure) if closure is not None else optimizer.step()), False
        self._watch_steps(optimizer)
        self._count_skips(self._uncounted)
        self._uncounted = []
        self._stepped.pop(id(optimizer), None)
        if (
            id(optimizer) in self._stepped_since_update
        ):  # a new iteration, though not every optimizer stepped in the last
            self._update_scale()
        result = self.scaler.step(optimizer, closure) if closure is not None else self.scaler.step(optimizer)
        self._stepped_since_update.add(id(optimizer))
        if len(self._stepped_since_update) >= self.optimizers_per_step:
            self._update_scale()
        # Skipped: the scaler did not call optimizer.step (known without reading the scale: no host sync
        # beyond the scaler's own read of its inf check), or a fused one was told found_inf.
        ran = self._stepped.pop(id(optimizer), False)
        if isinstance(ran, DeviceVerdict):
            self._uncounted.append(ran)
            return result, ran
        self._count_skips([not ran])
        return result, not ran

    def _count_skips(self, verdicts: list[Any]) -> None:
        """Fold steps' verdicts (in order) into ``consecutive_skips``; warn while skips go on."""
        for skipped in verdicts:
            self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
            run = self.consecutive_skips
            if run >= FP16_SKIP_RUN and run & (run - 1) == 0:  # 8, 16, 32, ...: said while it goes on
                warn(
                    f"fp16: the last {run} optimizer steps were all skipped (their gradients overflowed fp16 to "
                    f"inf/NaN) and the loss scale fell to {self.scaler.get_scale():.3g}: the model is not training. "
                    "Train in bf16 (fp16's speed, fp32's range), lower the learning rate, or clip gradients "
                    "(accelerator.clip_grad_norm_)."
                )

    def _update_scale(self) -> None:
        """The iteration's one scale update; every optimizer's gradients may be unscaled again."""
        self.scaler.update()
        self._unscaled.clear()
        self._stepped_since_update.clear()

    def _watch_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Note each real step of ``optimizer`` (a step post-hook, registered once). GradScaler hands
        a fused optimizer its inf check as the attribute ``found_inf`` for the step's length."""
        if id(optimizer) not in self._watched:
            self._watched.add(id(optimizer))
            optimizer.register_step_post_hook(self._note_step)

    def _note_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        found_inf = getattr(optimizer, "found_inf", None)
        self._stepped[id(optimizer)] = DeviceVerdict(found_inf) if isinstance(found_inf, torch.Tensor) else True

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of it: the fp16 scaler's state (None without one)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state)


class DeviceVerdict:
    """Whether a fused optimizer's step was skipped, as the loss scaler's ``found_inf`` on the device
    says. Truth-tested when asked (``step_was_skipped``, the LR scheduler's step): on CUDA the value is
    copied to pinned host memory as the step is queued and an event marks it, so reading it waits for
    that step's kernels only, never for work queued after it."""

    def __init__(self, found_inf: torch.Tensor):
        self._ready = None
        if found_inf.device.type == "cuda":
            self._host = torch.empty(found_inf.shape, dtype=found_inf.dtype, pin_memory=True)
            self._host.copy_(found_inf, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = found_inf.detach().clone()
        self._value: bool | None = None

    def __bool__(self) -> bool:
        if self._value is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._value = bool(self._host.item() != 0)
        return self._value

    def __repr__(self) -> str:
        return f"DeviceVerdict({'unread' if self._value is None else self._value})"
