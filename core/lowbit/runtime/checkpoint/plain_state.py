"""The state of an object registered for checkpointing, written so that lowbit's safe reader
(``torch.load(weights_only=True)``) reads it back as it was.

That reader refuses pickled classes beyond torch's own and Python's plain ones, so a state holding
a ``pathlib.Path``, a NumPy scalar or array, a ``frozenset`` or a ``range`` (and a ``set``, on torch
releases before 2.13) was saved, then refused at load as a damaged file. Such values are written as
tagged plain dicts and turned back into their own types at load. A value of any other type is
refused at save, naming the object and the type: before a preemption depends on the file.
"""

from __future__ import annotations

import pathlib
from collections import OrderedDict
from typing import Any

import torch

from lowbit.kernel.errors import CheckpointError

TAG = "__lowbit_value__"
# Leaves the safe reader takes as they are.
PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.Size, torch.dtype, torch.device)


def encode(state: Any, owner: str) -> Any:
    """``state`` with every value the safe reader refuses written as a tagged dict; ``owner`` names
    the object in the error for a value that cannot be written so."""
    return _encode(state, owner, "state_dict()")


def _encode(value: Any, owner: str, where: str) -> Any:
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, dict) and TAG not in value:
        items = [(_encode(k, owner, f"{where} key"), _encode(v, owner, f"{where}[{k!r}]")) for k, v in value.items()]
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if type(value) in (list, tuple):
        return type(value)(_encode(item, owner, f"{where}[{i}]") for i, item in enumerate(value))
    if isinstance(value, (set, frozenset)):
        kind = "frozenset" if isinstance(value, frozenset) else "set"
        return {TAG: kind, "items": [_encode(item, owner, f"{where} item") for item in value]}
    if isinstance(value, pathlib.PurePath):
        return {TAG: "path", "value": str(value)}
    if isinstance(value, range):
        return {TAG: "range", "value": (value.start, value.stop, value.step)}
    if type(value).__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            return {TAG: "ndarray", "value": torch.from_numpy(value.copy())}
        if isinstance(value, np.generic) and value.dtype.kind in "biufc":
            return {TAG: "numpy", "dtype": str(value.dtype), "value": value.item()}
    raise CheckpointError(
        f"save_state: {owner}'s state holds a {type(value).__module__}.{type(value).__qualname__} at {where}, "
        "which lowbit's checkpoint reader cannot read back (it loads no pickled classes). Nothing was written. "
        "Return plain values from its state_dict() (numbers, strings, lists, dicts, tensors, paths, NumPy values)."
    )


def decode(state: Any) -> Any:
    """What :func:`encode` wrote, with each tagged value its own type again."""
    if isinstance(state, dict):
        tag = state.get(TAG)
        if tag is None:
            items = [(decode(k), decode(v)) for k, v in state.items()]
            return OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
        if tag in ("set", "frozenset"):
            return (set if tag == "set" else frozenset)(decode(item) for item in state["items"])
        if tag == "path":
            return pathlib.Path(state["value"])
        if tag == "range":
            return range(*state["value"])
        if tag == "ndarray":
            return state["value"].numpy()
        if tag == "numpy":
            import numpy as np

            return np.dtype(state["dtype"]).type(state["value"])
    if type(state) in (list, tuple):
        return type(state)(decode(item) for item in state)
    return state
