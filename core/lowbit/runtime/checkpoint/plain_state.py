"""The state of an object registered for checkpointing, written so that lowbit's safe reader
(``torch.load(weights_only=True)``) reads it back as it was.

That reader refuses pickled classes beyond torch's own and Python's plain ones, so a state holding
a ``pathlib.Path``, a NumPy scalar or array, a ``frozenset`` or a ``range`` (and a ``set``, on torch
releases before 2.13) was saved, then refused at load as a damaged file; and a subclass of a plain
type (``np.float64`` of float, ``np.str_`` of str, an ``IntEnum`` of int, ``defaultdict`` and
``Counter`` of dict) went the same way, or came back as its base type. Such values are written as
tagged plain dicts, by their exact type, and turned back into that type at load (an enum or a
namedtuple by its class, found among the modules already imported). A value of any other type is
refused at save, naming the object and the type: before a preemption depends on the file.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import enum
import fractions
import pathlib
import sys
import uuid
from collections import OrderedDict
from typing import Any

import torch

from lowbit.kernel.errors import CheckpointError

TAG = "__lowbit_value__"
# Leaves the safe reader takes as they are: these exact types (a subclass, np.float64 of float or an
# IntEnum of int, would be pickled as its own class and refused at load), and tensors.
PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device})
# Standard-library values written as their text or numbers, and rebuilt from them.
_PATHS = {cls.__name__: cls for cls in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath)}
_PATHS.update({"PosixPath": pathlib.PosixPath if sys.platform != "win32" else pathlib.PurePosixPath})
_PATHS.update({"WindowsPath": pathlib.WindowsPath if sys.platform == "win32" else pathlib.PureWindowsPath})
_SCALARS = {
    "datetime": (datetime.datetime, datetime.datetime.isoformat, datetime.datetime.fromisoformat),
    "date": (datetime.date, datetime.date.isoformat, datetime.date.fromisoformat),
    "time": (datetime.time, datetime.time.isoformat, datetime.time.fromisoformat),
    "timedelta": (datetime.timedelta, lambda v: (v.days, v.seconds, v.microseconds), lambda v: datetime.timedelta(*v)),
    "decimal": (decimal.Decimal, str, decimal.Decimal),
    "fraction": (fractions.Fraction, str, fractions.Fraction),
    "uuid": (uuid.UUID, str, uuid.UUID),
}
# defaultdict factories that are named, not pickled.
_FACTORIES = {f.__name__: f for f in (int, float, str, list, dict, set, tuple, bool, bytes)}
NUMPY_KINDS = "biufcUS"  # bool, ints, floats, complex, str, bytes: one value each, rebuilt by dtype


def encode(state: Any, owner: str) -> Any:
    """``state`` with every value the safe reader refuses written as a tagged dict; ``owner`` names
    the object in the error for a value that cannot be written so."""
    return _encode(state, owner, "state_dict()")


def _refuse(value: Any, owner: str, where: str, why: str = "") -> CheckpointError:
    return CheckpointError(
        f"save_state: {owner}'s state holds a {type(value).__module__}.{type(value).__qualname__} at {where}, "
        f"which lowbit's checkpoint reader cannot read back{why} (it loads no pickled classes). Nothing was "
        "written. Return plain values from its state_dict() (numbers, strings, lists, dicts, tensors, paths, "
        "NumPy values, enums)."
    )


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _encode(value: Any, owner: str, where: str) -> Any:  # noqa: C901 - one branch per type, in one place
    kind = type(value)
    if kind in PLAIN or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, enum.Enum):  # IntEnum, StrEnum, Flag: rebuilt from their class, by name
        return {TAG: "enum", "class": _class_name(kind), "value": _encode(value.value, owner, where)}
    if kind in (dict, OrderedDict, collections.Counter, collections.defaultdict) and TAG not in value:
        items = [[_encode(k, owner, f"{where} key"), _encode(v, owner, f"{where}[{k!r}]")] for k, v in value.items()]
        if kind is dict:  # as it is, unless a key had to be tagged (a tagged key is a dict: unhashable)
            tagged_key = any(isinstance(k, dict) for k, _ in items)
            return {TAG: "dict", "items": items} if tagged_key else {k: v for k, v in items}
        if kind is collections.defaultdict:
            factory = value.default_factory
            if factory is not None and _FACTORIES.get(getattr(factory, "__name__", "")) is not factory:
                raise _refuse(value, owner, where, f" (its default_factory {factory!r} is not a built-in type)")
            return {TAG: "defaultdict", "factory": getattr(factory, "__name__", None), "items": items}
        return {TAG: "ordereddict" if kind is OrderedDict else "counter", "items": items}
    if kind in (list, tuple):
        return kind(_encode(item, owner, f"{where}[{i}]") for i, item in enumerate(value))
    if kind is collections.deque:
        return {TAG: "deque", "items": [_encode(v, owner, f"{where} item") for v in value], "maxlen": value.maxlen}
    if isinstance(value, tuple) and hasattr(kind, "_fields"):  # a namedtuple: rebuilt from its class, by name
        return {TAG: "namedtuple", "class": _class_name(kind), "items": [_encode(v, owner, where) for v in value]}
    if kind in (set, frozenset):
        return {TAG: kind.__name__, "items": [_encode(item, owner, f"{where} item") for item in value]}
    if isinstance(value, pathlib.PurePath) and kind.__name__ in _PATHS:
        return {TAG: "path", "class": kind.__name__, "value": str(value)}
    if kind is range:
        return {TAG: "range", "value": (value.start, value.stop, value.step)}
    for name, (cls, write, _) in _SCALARS.items():
        if kind is cls:
            return {TAG: name, "value": write(value)}
    if kind.__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            return {TAG: "ndarray", "value": torch.from_numpy(value.copy())}
        if isinstance(value, np.generic) and value.dtype.kind in NUMPY_KINDS:
            return {TAG: "numpy", "dtype": value.dtype.str, "value": value.item()}
    raise _refuse(value, owner, where)


def _named_class(name: str) -> type:
    """A class written by :func:`_class_name`, found among the modules already imported (the
    reader imports nothing a checkpoint names)."""
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise CheckpointError(
            f"load_state: a registered object's state holds a value of class {name}, which is not importable "
            "here: import its module before load_state (lowbit imports nothing a checkpoint names)."
        )
    return found


def decode(state: Any, source: str = "the checkpoint") -> Any:
    """What :func:`encode` wrote, with each tagged value its own type again. A tag lowbit does not
    write, or one malformed (a crafted file), is a CheckpointError naming ``source`` and the entry."""
    try:
        return _decode(state, "state")
    except RecursionError:
        raise CheckpointError(f"{source}: the registered state is nested too deeply to be one lowbit wrote.") from None
    except _Malformed as exc:
        raise CheckpointError(f"{source}: {exc} (a damaged or crafted file); nothing was loaded from it.") from None


class _Malformed(Exception):
    """A tagged entry that lowbit did not write."""


# How deep a registered state may nest (lists in dicts in lists ...): far past any real one, and
# short of Python's recursion limit, which a crafted file would otherwise hit inside the reader.
MAX_DEPTH = 100


def _decode(state: Any, where: str, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise _Malformed(f"the registered state is nested more than {MAX_DEPTH} levels deep, at {where[:80]}...")
    if isinstance(state, dict):
        tag = state.get(TAG)
        if tag is None:
            items = [
                (_decode(k, f"{where} key", depth + 1), _decode(v, f"{where}[{k!r}]", depth + 1))
                for k, v in state.items()
            ]
            return OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
        if not isinstance(tag, str) or tag not in _BUILDERS:
            raise _Malformed(f"{where} holds an unknown tagged value {tag!r}")
        try:
            return _BUILDERS[tag](state, where, depth + 1)
        except CheckpointError:
            raise
        except _Malformed:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise _Malformed(f"{where} holds a malformed {tag!r} value ({type(exc).__name__}: {exc})") from None
    if type(state) in (list, tuple):
        return type(state)(_decode(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(state))
    return state


def _items(state: dict, where: str, depth: int) -> list[tuple[Any, Any]]:
    pairs = state["items"]
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise _Malformed(f"{where} holds a mapping whose items are not (key, value) pairs")
    return [(_decode(k, f"{where} key", depth), _decode(v, f"{where}[{k!r}]", depth)) for k, v in pairs]


def _elements(state: dict, where: str, depth: int) -> list[Any]:
    if not isinstance(state["items"], list):
        raise _Malformed(f"{where} holds a collection whose items are not a list")
    return [_decode(item, f"{where} item", depth) for item in state["items"]]


def _numpy_scalar(state: dict, where: str, depth: int) -> Any:
    import numpy as np

    dtype = np.dtype(state["dtype"])
    if dtype.kind not in NUMPY_KINDS:  # an object or structured dtype would build anything
        raise _Malformed(f"{where} holds a NumPy value of dtype {dtype.str!r}, which lowbit never writes")
    return dtype.type(state["value"])


def _ndarray(state: dict, where: str, depth: int) -> Any:
    value = state["value"]
    if not isinstance(value, torch.Tensor):
        raise _Malformed(f"{where} holds an array that is not a tensor")
    return value.numpy()


def _defaultdict(state: dict, where: str, depth: int) -> Any:
    factory = state["factory"]
    if factory is not None and factory not in _FACTORIES:
        raise _Malformed(f"{where} holds a defaultdict with an unknown factory {factory!r}")
    return collections.defaultdict(_FACTORIES[factory] if factory else None, _items(state, where, depth))


_BUILDERS = {
    "dict": lambda s, w, d: dict(_items(s, w, d)),
    "ordereddict": lambda s, w, d: OrderedDict(_items(s, w, d)),
    "counter": lambda s, w, d: collections.Counter(dict(_items(s, w, d))),  # Counter(pairs) would count the pairs
    "defaultdict": _defaultdict,
    "set": lambda s, w, d: set(_elements(s, w, d)),
    "frozenset": lambda s, w, d: frozenset(_elements(s, w, d)),
    "deque": lambda s, w, d: collections.deque(_elements(s, w, d), s["maxlen"]),
    "enum": lambda s, w, d: _named_class(s["class"])(_decode(s["value"], w, d)),
    "namedtuple": lambda s, w, d: _named_class(s["class"])(*_elements(s, w, d)),
    "path": lambda s, w, d: _PATHS[s.get("class", "PosixPath")](str(s["value"])),
    "range": lambda s, w, d: range(*(int(v) for v in s["value"])),
    "ndarray": _ndarray,
    "numpy": _numpy_scalar,
    **{name: (lambda s, w, d, read=read: read(s["value"])) for name, (_, _, read) in _SCALARS.items()},
}
