"""Typed option specs, and parsing of option values from YAML, env vars and CLI strings.

One spec per option gives its type, default, valid choices and env var, so the config file,
the environment, the launcher and the recipe-kwargs classes all check values the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from lowbit.kernel.errors import ConfigError, unknown_choice

_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n"}


@dataclass(frozen=True)
class OptionSpec:
    """One option: ``type`` is bool, int, float, str or "bools3" (a 3-tuple of bools)."""

    name: str
    type: Any
    default: Any = None
    choices: tuple[str, ...] | None = None
    help: str = ""
    env: str = ""
    # Case-insensitive choices are returned in their canonical spelling ("hybrid" -> "HYBRID").
    normalize: Callable[[Any], Any] | None = field(default=None, compare=False)
    code_only: bool = False  # a Python object (a config, a callable): not settable from text

    def parse(self, value: Any, where: str = "") -> Any:
        """Return ``value`` converted to this option's type, or raise ConfigError naming it."""
        if value is None or self.code_only:
            return value
        at = f" (from {where})" if where else ""
        try:
            parsed = _convert(self.type, value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"Option {self.name!r}{at} expects {_type_name(self.type)}, got {value!r} "
                f"({type(value).__name__}). {exc}".rstrip()
            ) from None
        if self.normalize is not None:
            try:
                parsed = self.normalize(parsed)
            except ConfigError:
                raise
            except ValueError as exc:  # a range check: name the option and where it came from
                raise ConfigError(f"Option {self.name!r}{at}: {exc}") from None
        if self.choices is not None:
            canonical = {c.lower(): c for c in self.choices}
            if str(parsed).lower() not in canonical:
                raise ConfigError(unknown_choice(f"value for {self.name!r}{at}:", parsed, self.choices))
            parsed = canonical[str(parsed).lower()]
        return parsed


def at_least(minimum: int) -> Callable[[Any], Any]:
    """A ``normalize`` for a number option that must be ``minimum`` or more."""

    def check(value: Any) -> Any:
        if value is not None and value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}.")
        return value

    return check


def _type_name(kind: Any) -> str:
    return "three booleans, e.g. (false, false, false)" if kind == "bools3" else getattr(kind, "__name__", str(kind))


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError("Use true or false.")


def parse_bools3(value: Any) -> tuple[bool, bool, bool]:
    """Accept a list/tuple, or the text "(false, false, false)" that Accelerate's docs print."""
    if isinstance(value, str):
        items = [p for p in re.split(r"[\s,]+", value.strip().strip("()[]")) if p]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError("Give three booleans.")
    if len(items) != 3:
        raise ValueError(f"Give exactly three booleans (fprop, dgrad, wgrad); got {len(items)}.")
    return tuple(parse_bool(i) for i in items)  # type: ignore[return-value]


def _convert(kind: Any, value: Any) -> Any:
    if kind == "bools3":
        return parse_bools3(value)
    if kind is bool:
        return parse_bool(value)
    if kind is int:
        if isinstance(value, bool):
            raise ValueError("A boolean is not a number.")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError("Give a whole number.")
        return int(value)
    if kind is float:
        if isinstance(value, bool):
            raise ValueError("A boolean is not a number.")
        return float(value)
    if kind is str:
        if isinstance(value, (dict, list)):
            raise ValueError("Give a single word.")
        return str(value)
    if kind is dict:
        if not isinstance(value, dict):
            raise ValueError("Give a mapping (a YAML section).")
        return value
    return value


def to_text(value: Any) -> str:
    """The inverse of ``parse`` for env vars and CLI flags."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "(" + ", ".join(to_text(v) for v in value) + ")"
    return str(value)
