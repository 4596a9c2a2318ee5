"""What ``prepare()`` hands back for optimizers and schedulers.

The wrappers add what a plain script must not have to write: the precision's optimizer step (fp16
loss scaling with skipped steps on inf/nan, :mod:`lowbit.runtime.precision`), gradient accumulation
(step only on sync micro-batches), and the learning rate schedule stepped as Accelerate steps it.
Dataloaders are in :mod:`lowbit.runtime.training.data_loader`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lowbit.kernel import notices
from lowbit.kernel.types import ConversionReport

from lowbit.runtime.collective_device import on_group_device
from lowbit.runtime.precision import DeviceVerdict, Precision
from lowbit.runtime.training.gradient_sync import GradientSync


@dataclass
class PreparedObjects:
    """Everything ``prepare`` handed back, in order: what checkpoints save and loops step."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list["PreparedOptimizer"] = field(default_factory=list)
    schedulers: list["PreparedScheduler"] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    # Models prepared only to be evaluated (neither converted nor distributed; checkpoints leave them out).
    evaluated: list[torch.nn.Module] = field(default_factory=list)
    # What the low-precision backend's conversion took, by converted (unwrapped) model.
    conversion_reports: "weakref.WeakKeyDictionary[torch.nn.Module, ConversionReport]" = field(
        default_factory=weakref.WeakKeyDictionary
    )

    def clear(self) -> None:
        for objects in (
            self.models,
            self.optimizers,
            self.schedulers,
            self.dataloaders,
            self.evaluated,
            self.conversion_reports,
        ):
            objects.clear()


@dataclass
class TrainingCounters:
    """Counters a checkpoint carries: micro-batches seen by ``accumulate()``."""

    step: int = 0


@dataclass
class StepState:
    """What the prepared optimizers and schedulers need to know of the training loop: whether this
    micro-batch syncs, the run's precision (how an optimizer steps), how a schedule counts steps,
    and who observes each optimizer step (FP8 telemetry)."""

    gradient_sync: GradientSync
    precision: Precision
    num_processes: int = 1
    split_batches: bool = False
    step_scheduler_with_optimizer: bool = True
    step_observers: list[Callable[[], None]] = field(default_factory=list)
    # Run at every optimizer step, taken or skipped (a NaN, an fp16 overflow): what every rank must
    # run alike, a joined rank's shadow included (the preemption poll's collective).
    every_step: list[Callable[[], None]] = field(default_factory=list)
    # What a NaN/inf loss or gradient does to the optimizer step it feeds: "skip", "raise" or "continue".
    on_nonfinite_loss: str = "skip"
    # Whether the step reads the gradients themselves (False where the strategy owns them: DeepSpeed).
    check_gradients: bool = True
    # Whether every loss (and gradient) since the last optimizer step was finite: one bool tensor,
    # folded on the device and read once, at the step (None: nothing seen yet).
    finite_since_step: Any = None
    # The parameters whose gradients clip_grad_norm_ folded (by its norm) since the last step: the
    # step reads the others' only (a script may clip the body and leave the head unclipped).
    clipped: set[int] = field(default_factory=set)
    optimizer_steps: int = 0
    # Where a non-finite step's NaN/inf began, asked only when a step is found non-finite (None: not known).
    explain_nonfinite: Callable[[], str | None] | None = None
    # The prepared models' floating buffers holding NaN/inf (BatchNorm's running statistics take a
    # NaN batch in the forward, before any check), asked only when a step is found non-finite.
    nonfinite_buffers: Callable[[], list[str]] | None = None
    # Run when a step is skipped for NaN/inf, each saying what it put back (or None): BatchNorm's statistics.
    undo_on_skip: list[Callable[[], str | None]] = field(default_factory=list)
    # Whether steps look for NaN/inf at all, decided once from the two fields it follows: not with
    # on_nonfinite_loss="continue" (Accelerate's behaviour: no check, so no host sync), nor where the
    # loss scaler skips such steps itself (fp16).
    checks_nonfinite: bool = field(init=False)

    def __post_init__(self) -> None:
        self.checks_nonfinite = self.on_nonfinite_loss != "continue" and not self.precision.skips_nonfinite_steps

    def __getstate__(self) -> dict[str, Any]:
        # A pickled or copied optimizer carries its step state, not the run the diagnosis asks
        # (it holds modules and process-group state, which do not pickle): a copy reports without it.
        return {**self.__dict__, "explain_nonfinite": None, "nonfinite_buffers": None}

    def observe_finite(self, value: torch.Tensor, clipped: list[torch.Tensor] | None = None) -> None:
        """Fold a loss or gradient norm into the flag the next optimizer step reads (no host sync);
        ``clipped``: the parameters whose gradients ``value`` is the norm of."""
        if not self.checks_nonfinite:
            return
        if clipped is not None:
            self.clipped.update(id(p) for p in clipped)
        flag = torch.isfinite(value.detach()).all()
        if self.finite_since_step is None:
            self.finite_since_step = flag
        else:  # a model spread over devices (device_map) gives flags on several
            self.finite_since_step = self.finite_since_step & flag.to(self.finite_since_step.device)

    def observe_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Fold whether the gradients this step applies are finite: every parameter ``optimizer``
        updates, but those clip_grad_norm_ already folded.

        A NaN/inf gradient can come from a finite loss (an overflow in backward); NaN and inf
        survive the reduction (``finite_reduction``), read with the step's verdict: no host sync
        here. Each rank reads its own shard."""
        if self.check_gradients and self.checks_nonfinite:
            clipped = self.clipped
            # this rank's part of each gradient (FSDP2's are DTensors: reading the whole would be a collective)
            grads = [
                p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                for group in optimizer.param_groups
                for p in group["params"]
                if id(p) not in clipped
                and isinstance(getattr(p, "grad", None), torch.Tensor)
                and p.grad.is_floating_point()
            ]
            if grads:
                self.observe_finite(finite_reduction(grads, self.precision.device))
        self.clipped = set()

    def nonfinite_before_step(self) -> bool:
        """Whether a loss or gradient since the last step was NaN/inf: the one host sync of a step
        (none per micro-batch); several processes agree first, by one all-reduce of the flag (a NaN
        loss on one rank can leave every gradient finite: it must still skip everywhere)."""
        if self.finite_since_step is None:
            return False
        finite = self.finite_since_step.to(torch.int32)
        self.finite_since_step = None
        if self.num_processes > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                finite = on_group_device(finite)
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return not bool(finite)

    def shadow_finite_agreement(self) -> None:
        """On a rank with no batch left (``join_uneven_inputs``): take part in the others' agreement
        that their step was finite, answering "finite"."""
        if self.checks_nonfinite:
            import torch.distributed as dist

            dist.all_reduce(on_group_device(torch.ones((), dtype=torch.int32)), op=dist.ReduceOp.MIN)

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_sync.sync_gradients


def finite_reduction(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A small tensor that is finite exactly when ``grads`` are (up to overflow past fp32's range).
    On an accelerator, one fused kernel: their 2-norms, accumulated in fp32 (in fp16, finite
    gradients whose norm passes 65504 would read as inf and every step would be skipped), then their
    total (a norm past about 1e19 counts as inf, as in ``clip_grad_norm_``). On a CPU, where a
    kernel launch costs nothing and foreach runs tensor by tensor, one fp32 sum per gradient, 3x
    faster than the 2-norm there (the max norm: 40x slower); ``python bench/nonfinite_check.py``
    times each way."""
    if device.type == "cpu":
        return torch.stack([grad.sum(dtype=torch.float32) for grad in grads])
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))


class PreparedOptimizer(torch.optim.Optimizer):
    """Delegates to the real optimizer; steps only on sync micro-batches; unscales fp16 grads.

    Subclasses ``Optimizer`` (without running its ``__init__``) so that LR schedulers, which
    check ``isinstance(optimizer, Optimizer)``, accept it.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, step_state: StepState, after_step: Callable[[], None] | None = None
    ):
        self.optimizer = optimizer
        self._step_state = step_state
        self._after_step = after_step
        # Whether the last step was skipped, under Accelerate's attribute name (scripts and
        # Accelerate's own tests set it to fake an overflow); a fused fp16 step's is a DeviceVerdict,
        # read on the host only when asked.
        self._is_overflow: bool | DeviceVerdict = False
        # A strategy's optimizer that steps through its engine says itself whether the engine took
        # the step (DeepSpeed skips overflowing ones; its verdict is on the host already).
        self._reports_skips = isinstance(getattr(type(optimizer), "step_was_skipped", None), property)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow, or a NaN/inf caught)."""
        return bool(self._is_overflow)

    @step_was_skipped.setter
    def step_was_skipped(self, value: bool) -> None:
        self._is_overflow = value

    # Attributes an Optimizer is expected to have, read through to the real one.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __getstate__(self):
        # the wrapper whole (pickle, deepcopy), not Optimizer's own fields; a verdict as its value
        return {**self.__dict__, "_is_overflow": self.step_was_skipped}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __getattr__(self, name):
        # Methods of the optimizer it wraps (train()/eval() of schedule-free optimizers, ...).
        if name.startswith("__") or name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._step_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if not self._step_state.gradient_sync.sync_gradients:
            return None
        result = self._step(closure)
        for run in self._step_state.every_step:
            run()
        return result

    def _step(self, closure):
        step_state = self._step_state
        step_state.optimizer_steps += 1
        if step_state.checks_nonfinite:
            step_state.observe_gradients(self.optimizer)
            if step_state.nonfinite_before_step() and not self._nonfinite_continues(step_state):
                self.step_was_skipped = True
                return None
        result, self._is_overflow = step_state.precision.optimizer_step(self.optimizer, closure)
        if self._reports_skips and self._is_overflow is False:
            self._is_overflow = self.optimizer.step_was_skipped
        # A fused optimizer's verdict stays on the device: the step ran, so the bookkeeping after it
        # runs too (a skipped update left the weights as they were, which is what it reads).
        if self._is_overflow is not True:
            if self._after_step is not None:
                self._after_step()
            for observe in self._step_state.step_observers:
                observe()
        return result

    def weights_replaced(self) -> None:
        """The weights changed outside a step (``load_state``): redo the backend's per-step work
        that reads them (torchao's float8 all-gather scales), or the next forward uses stale values."""
        if self._after_step is not None:
            self._after_step()

    @staticmethod
    def _nonfinite_continues(step_state: StepState) -> bool:
        """Say so, then raise, skip (False) or continue (True), as ``on_nonfinite_loss`` asks."""
        what = f"the loss or a gradient of optimizer step {step_state.optimizer_steps} is NaN or inf"
        origin = _origin(step_state)
        if origin:
            what += f" (replayed: {origin})"
        if step_state.on_nonfinite_loss == "raise":
            raise FloatingPointError(f"{what} (on_nonfinite_loss='raise').")
        undone = [said for said in (undo() for undo in step_state.undo_on_skip) if said]
        buffers = (step_state.nonfinite_buffers() if step_state.nonfinite_buffers is not None else None) or []
        spoiled = (
            f" But the forward already folded it into {len(buffers)} buffer(s): {', '.join(buffers[:5])}; they stay "
            "NaN/inf (every later eval is NaN, and save_state refuses them): load the last checkpoint."
            if buffers
            else ""
        )
        put_back = f" {'; '.join(undone)}." if undone else ""
        notices.warn(
            f"{what}; the step is skipped, the weights are unchanged (on_nonfinite_loss='skip'; "
            f"accelerator.optimizer_step_was_skipped is True).{put_back}{spoiled}"
        )
        return False


def _origin(step_state: StepState) -> str | None:
    """Where the NaN/inf began (a replay of the step's batch), or None; a replay that fails says so."""
    if step_state.explain_nonfinite is None:
        return None
    try:
        return step_state.explain_nonfinite()
    except Exception as exc:  # noqa: BLE001 - the diagnosis never replaces the report it adds to
        return f"the replay to find where it began failed: {type(exc).__name__}: {str(exc)[:200]}"


class PreparedScheduler:
    """Steps the LR schedule as Accelerate does, so a script gets the same learning rates.

    Not on accumulation micro-batches or skipped fp16 steps. On an optimizer step it advances
    ``num_processes`` times (unless ``split_batches``): a schedule written for one process counts
    batches of the whole dataset, and each step of N processes consumes N batches. With
    ``step_scheduler_with_optimizer=False`` every call steps once, as the user wrote it.
    """

    def __init__(self, scheduler, optimizers: list[PreparedOptimizer], step_state: StepState):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self._step_state = step_state

    def step(self, *args, **kwargs):
        step_state = self._step_state
        if not step_state.step_scheduler_with_optimizer:
            return self.scheduler.step(*args, **kwargs)
        if not step_state.sync_gradients or any(opt.step_was_skipped for opt in self.optimizers):
            return None
        repeats = 1 if step_state.split_batches else step_state.num_processes
        for _ in range(repeats):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)
        return None

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def __getattr__(self, name):
        return getattr(self.scheduler, name)
