"""MS-AMP state in lowbit checkpoints: ``ScalingTensor`` as tensors and plain data.

MS-AMP keeps converted weights (``FP8Linear.weight``, a ScalingParameter) and, at O2, Adam's
moments as ``ScalingTensor``: a plain Python object holding a ``value`` tensor and a
``ScalingMeta`` (``msamp/common/tensor/tensor.py`` and ``meta.py``). ``torch.load(weights_only=True)``,
which lowbit reads every checkpoint file with, refuses such objects, so ``save_state`` writes
each one as a tagged dict of its tensors and the name of its qtype, and ``load_state`` builds
the ScalingTensor again.
"""
from __future__ import annotations

from typing import Any

TAG = "__lowbit_msamp_scaling_tensor__"


def is_scaling_tensor(value: Any) -> bool:
    meta = getattr(value, "meta", None)
    return hasattr(value, "value") and hasattr(meta, "qtype") and hasattr(meta, "scale")


def encode(value: Any) -> Any:
    """``value`` with every ScalingTensor in it (dicts, lists, tuples) turned into a tagged dict."""
    if is_scaling_tensor(value):
        meta = value.meta
        return {TAG: 1, "value": value.value, "qtype": meta.qtype.name, "scale": meta.scale,
                "scale_inv": meta.scale_inv, "amax": meta.amax, "window_size": int(meta.window_size)}
    if isinstance(value, dict):
        return type(value)((k, encode(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(encode(v) for v in value)
    return value


def device_of(owner: Any) -> Any:
    """Where ``owner``'s (a model's or an optimizer's) parameters live: lowbit reads checkpoint files
    onto the CPU, and MS-AMP's optimizer moves only plain tensors to their parameter's device
    (``msamp/optim/optimizer.py`` ``load_state_dict``), so ScalingTensors are placed here."""
    params = owner.parameters() if hasattr(owner, "parameters") else (
        p for group in getattr(owner, "param_groups", []) for p in group["params"])
    return next((p.device for p in params if hasattr(p, "device")), "cpu")


def decode(value: Any, msamp: Any, device: Any = "cpu") -> Any:
    """Undo :func:`encode` with ``msamp``'s own classes, the tensors on ``device``."""
    if isinstance(value, dict) and value.get(TAG) == 1:
        import msamp.common.dtype  # noqa: F401 - subpackages, loaded by `import msamp` too
        import msamp.common.tensor  # noqa: F401

        qtypes = {q.name: q for q in vars(msamp.common.dtype.Dtypes).values() if hasattr(q, "name") and hasattr(q, "value")}
        if value["qtype"] not in qtypes:
            raise ValueError(f"MS-AMP has no qtype {value['qtype']!r} (known: {', '.join(sorted(qtypes))})")
        scale, scale_inv, amax = (value[k].to(device) for k in ("scale", "scale_inv", "amax"))
        meta = msamp.common.tensor.ScalingMeta(qtypes[value["qtype"]], scale=scale, scale_inv=scale_inv, amax=amax,
                                               window_size=value["window_size"])
        return msamp.common.tensor.ScalingTensor(value["value"].to(device), meta)
    if isinstance(value, dict):
        return type(value)((k, decode(v, msamp, device)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(decode(v, msamp, device) for v in value)
    return value
