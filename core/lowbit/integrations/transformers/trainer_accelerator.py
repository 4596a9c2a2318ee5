"""What transformers' ``Trainer`` (and every TRL trainer) gets under :func:`lowbit.patch_trainer`.

Three things a Trainer user cannot do in the script, done here:

- **The precision asked of the launcher reaches the run.** Trainer passes
  ``mixed_precision=args.mixed_precision`` explicitly: "no" unless ``bf16``/``fp16`` is set or
  ``ACCELERATE_MIXED_PRECISION`` is, so ``lowbit launch --mixed_precision fp8`` would train fp32 with
  no word. Trainer's "no" is its default, and yields to the launcher's setting; an asked FP8 wins
  over ``bf16=True`` (TRL's configs default to it) with a note (FP8 runs the layers it does not
  convert in bf16 autocast); any other disagreement is an error naming both.
- **The first line says the run is on lowbit**, with the precision, the backend and why.
- **lowbit's throughput figures reach Trainer's reporting integrations** (TensorBoard, W&B, ...)
  and the console, through a callback placed before them; ``log_history`` stays stock's.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from transformers import TrainerCallback

from lowbit.kernel.errors import ConfigError
from lowbit.kernel.notices import note

from lowbit.run.settings import normalize_precision, read_config_layer, setting_layers

from lowbit.compat.accelerator import Accelerator

# The Accelerator a Trainer built last: its figures callback, made in the same Trainer.__init__, reads it.
_LATEST: dict[str, Any] = {"ref": lambda: None}


def launcher_precision(config_file: Any = None) -> tuple[str | None, str]:
    """The ``mixed_precision`` the launcher, the environment or the config file asked for (not an
    argument), and where it came from; (None, "") when none did."""
    for raw, where in reversed(setting_layers(None, os.environ, read_config_layer(config_file))):
        if raw.get("mixed_precision") is not None:
            value = normalize_precision(str(raw["mixed_precision"]).lower())
            if where == "environment variables":  # lowbit launch passes its flags and config file this way
                where = "LOWBIT_MIXED_PRECISION (lowbit launch --mixed_precision or its config file)"
            return value, where
    return None, ""


def precision_under_trainer(from_trainer: str | None, asked: str | None, where: str) -> tuple[str, str | None]:
    """The precision to train in, from Trainer's argument and the one asked outside the script, and
    what to tell the user when the asked one overrides the Trainer's (None: nothing to say)."""
    trainer = str(getattr(from_trainer, "value", from_trainer) or "no").lower()
    if asked is None or asked == trainer:
        return trainer, None
    if trainer == "no":  # Trainer's default: the launcher's choice stands
        return asked, None
    if asked == "no":  # the launcher left it at fp32; the script's bf16=True or fp16=True stands
        return trainer, None
    if asked in ("fp8", "fp4") and trainer == "bf16":
        return asked, (
            f"mixed_precision={asked!r} from {where} wins over the Trainer's bf16=True (TRL's configs default "
            f"to it): the layers the backend converts train in {asked}, the rest in bf16 autocast, as any "
            f"{asked} run does."
        )
    raise ConfigError(
        f"The Trainer asks for mixed_precision={trainer!r} (TrainingArguments' fp16/bf16) and {where} asks for "
        f"{asked!r}. "
        f"Say one: drop --mixed_precision (or the config's mixed_precision) to keep the Trainer's, or set "
        f"{'fp16' if trainer == 'fp16' else 'bf16'}=False in the TrainingArguments to use {asked!r}."
    )


class TrainerAccelerator(Accelerator):
    """lowbit's Accelerator as a Trainer builds it: the precision asked outside the script counts,
    the first line says what runs, and lowbit's figures join Trainer's logs."""

    def __init__(self, *args: Any, mixed_precision: Any = None, config_file: Any = None, **kwargs: Any) -> None:
        asked, where = launcher_precision(config_file)
        mixed_precision, overridden = precision_under_trainer(mixed_precision, asked, where)
        super().__init__(*args, mixed_precision=mixed_precision, config_file=config_file, **kwargs)
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
        if overridden:
            note(overridden)


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
