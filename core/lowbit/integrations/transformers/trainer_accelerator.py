"""What transformers' ``Trainer`` (and every TRL trainer) gets under :func:`lowbit.patch_trainer`.

Three things a Trainer user cannot do in the script, done here:

- **The precision asked of the launcher reaches the run.** Trainer passes
  ``mixed_precision=args.mixed_precision`` explicitly: "no" unless ``bf16``/``fp16`` is set or
  ``ACCELERATE_MIXED_PRECISION`` is, so ``lowbit launch --mixed_precision fp8`` would train fp32 with
  no word. Trainer's precision goes to the run as the front's default (``RunRequest.front_precision``),
  which the run weighs in its one reading of the settings (``run/settings.precision_under_front``):
  "no" yields to the launcher's setting; an asked FP8 wins over ``bf16=True`` (TRL's configs default
  to it) with a note (FP8 runs the layers it does not convert in bf16 autocast); any other
  disagreement is an error naming both.
- **The first line says the run is on lowbit**, with the precision, the backend and why.
- **lowbit's throughput figures reach Trainer's reporting integrations** (TensorBoard, W&B, ...)
  and the console, through a callback placed before them; ``log_history`` stays stock's.
"""

from __future__ import annotations

import weakref
from typing import Any

from transformers import TrainerCallback

from lowbit.kernel.notices import note

from lowbit.run.settings import normalize_precision
from lowbit.run.training_run import RunRequest

from lowbit.compat.accelerator import Accelerator

# The Accelerator a Trainer built last: its figures callback, made in the same Trainer.__init__, reads it.
_LATEST: dict[str, Any] = {"ref": lambda: None}


class TrainerAccelerator(Accelerator):
    """lowbit's Accelerator as a Trainer builds it: the precision asked outside the script counts,
    the first line says what runs, and lowbit's figures join Trainer's logs."""

    def __init__(self, *args: Any, mixed_precision: Any = None, **kwargs: Any) -> None:
        # Trainer's precision is its default, not an argument: the run weighs it against what the
        # launcher, the environment and the config file ask, in its one reading of them.
        self._trainer_precision = str(getattr(mixed_precision, "value", mixed_precision) or "no").lower()
        super().__init__(*args, **kwargs)
        _LATEST["ref"] = weakref.ref(self)
        if self.fp8_backend is not None:
            why = self.explain_backend_choice().splitlines()[0].partition("(")[2].rstrip(").")
            how = f"{self.mixed_precision} by the {self.fp8_backend!r} backend ({why})"
        else:
            how = (
                f"{self.mixed_precision} by torch's autocast"
                if self.mixed_precision != "no"
                else "fp32 (mixed_precision 'no')"
            )
        kind = getattr(self.distributed_type, "value", self.distributed_type)
        note(
            f"transformers' Trainer runs on lowbit's Accelerator: {how}; {self.num_processes} process"
            f"{'es' if self.num_processes > 1 else ''} ({kind}). accelerator.explain_backend_choice() says why."
        )
        if self._run.plan.front_precision_overridden:
            note(self._run.plan.front_precision_overridden)

    def _run_request(self, *args: Any, **kwargs: Any) -> RunRequest:
        request = super()._run_request(*args, **kwargs)
        request.front_precision = normalize_precision(self._trainer_precision)
        request.front_name = "the Trainer"  # its TrainingArguments' fp16/bf16 (TRL's configs default to bf16)
        return request


class LowbitFiguresCallback(TrainerCallback):
    """Adds lowbit's throughput figures (``throughput/tokens_per_s``, ``.../mfu``,
    ``.../fp8_gemm_share``, ...) of the last optimizer step to each training log the Trainer hands
    its callbacks: the reporting integrations and the console, which run after it. Not to
    ``state.log_history`` (written before the callbacks run): it stays what stock Trainer writes,
    so that two identical runs, or a run and its resume, have equal histories, and no wall-clock
    value lands in ``trainer_state.json``."""

    def __init__(self) -> None:
        self.accelerator: Any = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.accelerator = _LATEST["ref"]()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        figures = getattr(self.accelerator, "throughput", None) or {}
        if not figures or logs is None or "loss" not in logs:  # training logs only (not eval, not the summary)
            return
        logs.update({key: value for key, value in figures.items() if key not in logs})
