"""A number or a switch from an environment variable, refused with its name.

``LOWBIT_PREEMPTION_POLL_STEPS=abc`` once surfaced as a ZeroDivisionError on rank 1 mid-run: every
numeric ``LOWBIT_*`` variable is read through :func:`env_number`, whose error names the variable,
the value it held, and the range it takes. ``LOWBIT_SIMULATE_NCCL=true`` once left the simulation
off unsaid (only ``1`` counted): every on/off ``LOWBIT_*`` variable is read through
:func:`env_switch`, which takes the same truth values everywhere.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

from lowbit.kernel.errors import ConfigError

# On CPU processes, hold lowbit's collectives to NCCL's device rule (runtime/collective_device.py
# reads it; `lowbit launch --simulate_nccl` sets it). Named here, below torch: the launcher sets it
# without importing torch.
SIMULATE_NCCL_ENV = "LOWBIT_SIMULATE_NCCL"


def env_number(
    name: str,
    default: float,
    *,
    whole: bool = False,
    minimum: float = 0.0,
    above_minimum: bool = False,
    meaning: str = "",
) -> float:
    """``name``'s value as a number (``whole``: an int), ``default`` when unset or empty.

    It must be at least ``minimum`` (more than it with ``above_minimum``); ``meaning`` says what it
    counts ("seconds", "optimizer steps") in the error."""
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return int(default) if whole else default
    kind = "a whole number" if whole else "a number"
    bound = f"{'more than' if above_minimum else 'at least'} {minimum:g}"
    wanted = f"{kind} {bound}{f' ({meaning})' if meaning else ''}"
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        raise ConfigError(
            f"Environment variable {name}={raw!r} is not {kind}: it takes {wanted}; unset it for "
            f"the default, {default:g}."
        ) from None
    if math.isnan(value) or value < minimum or (above_minimum and value == minimum):
        raise ConfigError(
            f"Environment variable {name}={raw!r} is out of range: it takes {wanted}; unset it for "
            f"the default, {default:g}."
        )
    return value


SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """``name``'s value as on/off (``1/true/yes/on`` or ``0/false/no/off``, any case), ``default``
    when unset or empty; anything else is an error naming the variable."""
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    if raw.lower() in SWITCH_ON:
        return True
    if raw.lower() in SWITCH_OFF:
        return False
    raise ConfigError(
        f"Environment variable {name}={raw!r} is not a switch: it takes {'/'.join(SWITCH_ON)} to turn it on or "
        f"{'/'.join(SWITCH_OFF)} to turn it off; unset it for the default ({'on' if default else 'off'})."
    )


# Accelerate's truth values for its own ACCELERATE_* variables and config booleans (its
# ``utils.environment.str_to_bool``), in any case: read with these wherever lowbit reads Accelerate's.
ACCELERATE_TRUE = frozenset({"y", "yes", "t", "true", "on", "1"})
ACCELERATE_FALSE = frozenset({"n", "no", "f", "false", "off", "0"})


def accelerate_flag(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether Accelerate would read ``name`` as on (``t``, ``y``, ``On`` too); off when unset."""
    return str(environ.get(name, "")).strip().lower() in ACCELERATE_TRUE
