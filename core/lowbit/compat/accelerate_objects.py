"""Accelerate's own settings objects handed to lowbit's Accelerator, rebuilt as lowbit's.

transformers' ``Trainer`` builds some of its Accelerator's arguments with Accelerate's classes
imported inside its functions (``TorchDynamoPlugin``, ``FullyShardedDataParallelPlugin``,
``DeepSpeedPlugin``, ``ParallelismConfig``), and a script may mix ``accelerate.utils`` handlers
with lowbit's Accelerator. Each such object becomes lowbit's class of the same name, field by
field; a field lowbit's class does not have is refused when it is set away from Accelerate's
default (lowbit cannot honour it), never dropped silently.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import Any

from lowbit.kernel.errors import NOT_OFFERED_MARK, ConfigError


def _in_accelerate(module: str | None) -> bool:
    return module == "accelerate" or (module or "").startswith("accelerate.")


def is_from_accelerate(obj: Any) -> bool:
    return _in_accelerate(type(obj).__module__)


def lowbit_counterpart(obj: Any) -> Any:
    """lowbit's object for an Accelerate class or function (same name, at the same module path, at
    the top level, or in ``lowbit.utils``), or None when lowbit does not offer it."""
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__name__", None)
    if not name or not _in_accelerate(module):
        return None
    for path in ("lowbit" + module[len("accelerate") :], "lowbit", "lowbit.compat.utils"):
        try:
            found = getattr(importlib.import_module(path), name)
        except (ImportError, AttributeError):
            continue
        if not hasattr(found, NOT_OFFERED_MARK):  # a stand-in that refuses is not lowbit offering it
            return found
    return None


def from_accelerate(obj: Any) -> Any:
    """lowbit's object for an instance of an Accelerate settings class; anything else as it is."""
    if obj is None or not is_from_accelerate(obj) or not dataclasses.is_dataclass(obj):
        return obj
    cls = type(obj)
    ours = lowbit_counterpart(cls)
    if ours is None:
        raise ConfigError(
            f"{cls.__module__}.{cls.__name__} (Accelerate's) has no counterpart in lowbit, so its settings "
            "cannot be honoured. Leave it out, or see docs/coming-from-accelerate.md for what lowbit offers."
        )
    our_fields = {f.name for f in dataclasses.fields(ours) if f.init} if dataclasses.is_dataclass(ours) else None
    defaults = _defaults(obj)
    given: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if not field.init or _same(value, defaults.get(field.name, value)):
            continue  # left at Accelerate's default: lowbit's own default stands
        if our_fields is None or field.name in our_fields:
            given[field.name] = _as_ours(value)
        else:
            raise ConfigError(
                f"{cls.__name__}({field.name}={value!r}) from Accelerate is not supported by lowbit: lowbit's "
                f"{cls.__name__} has no {field.name!r} setting. Leave it at its default ({defaults.get(field.name)!r})."
            )
    return ours(**given)


def _defaults(obj: Any) -> dict[str, Any]:
    """Accelerate's values for an object made with no arguments (its __post_init__ fills some from
    the environment), else the declared defaults."""
    try:
        fresh = type(obj)()
        return {f.name: getattr(fresh, f.name) for f in dataclasses.fields(fresh)}
    except Exception:  # a class that needs arguments or a process group to be made
        out = {}
        for f in dataclasses.fields(obj):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out


def _same(value: Any, default: Any) -> bool:
    try:
        # Unset in both spellings (None, False, "", "none") is the default; a 0 is a value (0 == False
        # in Python, so num_steps=0 once passed as unset and became 1 silently).
        unset = value is None or value is False or value in ("", "none")
        return (bool(value == default) and type(value) is type(default)) or (unset and not default)
    except Exception:  # a value whose == is not a plain bool (a tensor)
        return value is default


def _as_ours(value: Any) -> Any:
    """Accelerate's enum members as lowbit's (by value); nested Accelerate objects rebuilt."""
    if isinstance(value, enum.Enum) and is_from_accelerate(value):
        ours = lowbit_counterpart(type(value))
        return ours(value.value) if ours is not None else value.value
    return from_accelerate(value)
