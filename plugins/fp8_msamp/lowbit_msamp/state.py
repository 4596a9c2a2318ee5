"""MS-AMP state in lowbit checkpoints: ``ScalingTensor`` as tensors and plain data.

MS-AMP keeps converted weights (``FP8Linear.weight``, a ScalingParameter) and, at O2, Adam's
moments as ``ScalingTensor``: a plain Python object holding a ``value`` tensor and a
``ScalingMeta`` (``msamp/common/tensor/tensor.py`` and ``meta.py``). ``torch.load(weights_only=True)``,
which lowbit reads every checkpoint file with, refuses such objects, so ``save_state`` writes
each one as a tagged dict of its tensors and the name of its qtype, and ``load_state`` builds
the ScalingTensor again.

Each FP8Linear also keeps ``scaling_metas`` (input, weight gradient, output gradient: scales, an
amax window of 16 steps for input and output gradient, and ``amax_counter``, the steps seen, which
decides when in-time scaling ends: ``ScalingMeta.is_warmup``, msamp/common/tensor/meta.py 0.4.0 and
main). They are plain attributes, in no state dict, so :func:`scaling_metas_state` saves them and
:func:`load_scaling_metas_state` copies them back in place: MS-AMP flattens them into shared
buffers (``model_state.register_scaling_metas``, msamp/nn/state.py), which new tensors would not reach.
"""

from __future__ import annotations

from typing import Any

TAG = "__lowbit_msamp_scaling_tensor__"
META_TENSORS = ("scale", "scale_inv", "amax", "amax_counter")


def is_scaling_tensor(value: Any) -> bool:
    meta = getattr(value, "meta", None)
    return hasattr(value, "value") and hasattr(meta, "qtype") and hasattr(meta, "scale")


def encode(value: Any) -> Any:
    """``value`` with every ScalingTensor in it (dicts, lists, tuples) turned into a tagged dict."""
    if is_scaling_tensor(value):
        meta = value.meta
        return {
            TAG: 1,
            "value": value.value,
            "qtype": meta.qtype.name,
            "window_size": int(meta.window_size),
            **{name: getattr(meta, name) for name in META_TENSORS},
        }
    if isinstance(value, dict):
        return type(value)((k, encode(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(encode(v) for v in value)
    return value


def device_of(owner: Any) -> Any:
    """Where ``owner``'s (a model's or an optimizer's) parameters live: lowbit reads checkpoint files
    onto the CPU, and MS-AMP's optimizer moves only plain tensors to their parameter's device
    (``msamp/optim/optimizer.py`` ``load_state_dict``), so ScalingTensors are placed here."""
    params = (
        owner.parameters()
        if hasattr(owner, "parameters")
        else (p for group in getattr(owner, "param_groups", []) for p in group["params"])
    )
    return next((p.device for p in params if hasattr(p, "device")), "cpu")


def decode(value: Any, msamp: Any, device: Any = "cpu") -> Any:
    """Undo :func:`encode` with ``msamp``'s own classes, the tensors on ``device``."""
    if isinstance(value, dict) and value.get(TAG) == 1:
        import msamp.common.dtype  # noqa: F401 - subpackages, loaded by `import msamp` too
        import msamp.common.tensor  # noqa: F401

        qtypes = {
            q.name: q for q in vars(msamp.common.dtype.Dtypes).values() if hasattr(q, "name") and hasattr(q, "value")
        }
        if value["qtype"] not in qtypes:
            raise ValueError(f"MS-AMP has no qtype {value['qtype']!r} (known: {', '.join(sorted(qtypes))})")
        scale, scale_inv, amax = (value[k].to(device) for k in ("scale", "scale_inv", "amax"))
        meta = msamp.common.tensor.ScalingMeta(
            qtypes[value["qtype"]], scale=scale, scale_inv=scale_inv, amax=amax, window_size=value["window_size"]
        )
        if "amax_counter" in value:  # not a constructor argument; checkpoints before lowbit kept it lack it
            meta.amax_counter.copy_(value["amax_counter"])
        return msamp.common.tensor.ScalingTensor(value["value"].to(device), meta)
    if isinstance(value, dict):
        return type(value)((k, decode(v, msamp, device)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(decode(v, msamp, device) for v in value)
    return value


def _metas_by_module(model: Any) -> dict[str, dict[str, Any]]:
    return {
        name: module.scaling_metas
        for name, module in model.named_modules()
        if isinstance(getattr(module, "scaling_metas", None), dict)
    }


def scaling_metas_state(model: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """``{module: {"input"|"wgrad"|"ograd": {"scale", "scale_inv", "amax", "amax_counter"}}}`` as CPU copies."""
    return {
        name: {
            kind: {t: getattr(meta, t).detach().to("cpu", copy=True) for t in META_TENSORS}
            for kind, meta in metas.items()
        }
        for name, metas in _metas_by_module(model).items()
    }


def load_scaling_metas_state(model: Any, state: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Copy :func:`scaling_metas_state`'s output into the model's metas, in place."""
    import torch

    metas = _metas_by_module(model)
    unknown = sorted(set(state) - set(metas))
    if unknown:
        raise ValueError(f"MS-AMP scaling state for module(s) this model does not have: {', '.join(unknown[:5])}")
    for name, kinds in state.items():
        for kind, saved in kinds.items():
            meta = metas[name][kind]
            if saved["amax"].shape != meta.amax.shape:
                raise ValueError(
                    f"{name}: the saved {kind} amax window has {saved['amax'].numel()} steps, this run's "
                    f"{meta.amax.numel()} (MS-AMP's window size changed?)"
                )
            with torch.no_grad():
                for t in META_TENSORS:
                    getattr(meta, t).copy_(saved[t])
