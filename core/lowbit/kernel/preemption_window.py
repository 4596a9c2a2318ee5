"""The preemption window and what a scheduler's early warning does, read from the environment by
both sides of a job: the launcher (which kills what outlives the window, and passes the warning on)
and the ranks (which save within the window). Below torch, so the launcher imports none."""

from __future__ import annotations

import os

from lowbit.kernel.env_numbers import env_number
from lowbit.kernel.errors import ConfigError

GRACE_ENV = "LOWBIT_PREEMPTION_GRACE"
# Seconds from SIGTERM until the launcher kills what is left: 5 s inside the common 30 s window,
# so that the launcher, not the scheduler's SIGKILL, ends the job and says what happened.
DEFAULT_GRACE_S = 25.0
WARNING_ENV = "LOWBIT_PREEMPTION_WARNING"
WARNING_ACTIONS = ("checkpoint", "stop")  # what SIGUSR1 does: the first is the default


def grace_seconds() -> float:
    """The window after SIGTERM (``LOWBIT_PREEMPTION_GRACE``), read where it is needed."""
    return env_number(GRACE_ENV, DEFAULT_GRACE_S, meaning="seconds the processes get to save after SIGTERM")


def warning_action() -> str:
    """What SIGUSR1 does (``LOWBIT_PREEMPTION_WARNING``): checkpoint and train on, or stop."""
    action = os.environ.get(WARNING_ENV, "").strip().lower() or WARNING_ACTIONS[0]
    if action not in WARNING_ACTIONS:
        raise ConfigError(
            f"{WARNING_ENV}={action!r}: give checkpoint (save at the early warning and train on) or stop "
            "(save and stop)."
        )
    return action
