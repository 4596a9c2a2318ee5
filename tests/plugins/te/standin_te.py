"""A CPU stand-in for ``transformer_engine``, for tests only (TE needs CUDA to import).

Every constructor and function lowbit-te calls has the exact signature of TE 2.20
(``test_te.py::test_standin_signatures_match_the_real_te`` checks them against the wheel's
source). ``transformer_engine.common.recipe`` is the REAL module, loaded from the wheel.
Calls are recorded so tests can see what reached TE.
"""
from __future__ import annotations

import importlib.machinery
import types
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

AUTOCAST_CALLS: list[dict[str, Any]] = []
CAPABILITY = {"fp8": (True, ""), "mxfp8": (False, "stand-in verdict: no MXFP8 GEMMs on this GPU"), "block": (True, "")}


class _TEModule(nn.Module):
    def get_extra_state(self) -> torch.Tensor:
        return torch.zeros(4)  # TE keeps FP8 scaling metadata here

    def set_extra_state(self, state: Any) -> None:
        self.loaded_extra_state = state


class Linear(_TEModule):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        parameters_split: Optional[Union[Tuple[str, ...], Dict[str, int]]] = None,
        device: Union[torch.device, str] = "cuda",
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        save_original_input: bool = False,
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.use_bias = bias
        # As in TE: without a bias, `bias` is an empty plain tensor, not None and not a parameter.
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else torch.Tensor().to(dtype=dtype, device=device)
        nn.init.normal_(self.weight)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias if self.use_bias else None)


class _Norm(_TEModule):
    """TE's LayerNorm and RMSNorm share this constructor signature."""

    has_bias = True

    def __init__(
        self,
        normalized_shape: Union[Iterable[int], int, None] = None,
        eps: float = 1e-5,
        sequence_parallel: Optional[bool] = None,
        params_dtype: Optional[torch.dtype] = None,
        zero_centered_gamma: bool = False,
        hidden_size: Optional[int] = None,
        **kwargs,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps = shape, eps
        dtype, device = params_dtype or torch.get_default_dtype(), kwargs.get("device", "cuda")
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        if self.has_bias:
            self.bias = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class LayerNorm(_Norm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(_Norm):
    has_bias = False

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class autocast:  # noqa: N801 - TE's name
    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        recipe: Optional["Recipe"] = None,  # noqa: F821
        amax_reduction_group: Optional["dist_group_type"] = None,  # noqa: F821
        _graph: bool = False,
    ) -> None:
        self.record = {"enabled": enabled, "recipe": recipe, "amax_reduction_group": amax_reduction_group, "api": "autocast"}

    def __enter__(self):
        AUTOCAST_CALLS.append(self.record)
        return self

    def __exit__(self, *exc):
        return False


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional["Recipe"] = None,  # noqa: F821
    fp8_group: Optional["dist_group_type"] = None,  # noqa: F821
    _graph: bool = False,
) -> "autocast":
    ctx = autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group)
    ctx.record["api"] = "fp8_autocast"
    return ctx


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return CAPABILITY["fp8"] if return_reason else CAPABILITY["fp8"][0]


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return CAPABILITY["mxfp8"] if return_reason else CAPABILITY["mxfp8"][0]


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return CAPABILITY["block"] if return_reason else CAPABILITY["block"][0]


def install(recipe_module: types.ModuleType) -> dict[str, types.ModuleType]:
    """Modules to put in ``sys.modules`` (the test uses monkeypatch.setitem on each)."""
    te = types.ModuleType("transformer_engine")
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    te.__path__ = []
    te.__version__ = "2.20.2"
    common = types.ModuleType("transformer_engine.common")
    common.__path__ = []
    common.recipe = recipe_module
    pytorch = types.ModuleType("transformer_engine.pytorch")
    for obj in (Linear, LayerNorm, RMSNorm, autocast, fp8_autocast, is_fp8_available, is_mxfp8_available,
                is_fp8_block_scaling_available):
        setattr(pytorch, obj.__name__, obj)
    te.common, te.pytorch = common, pytorch
    return {"transformer_engine": te, "transformer_engine.common": common,
            "transformer_engine.common.recipe": recipe_module, "transformer_engine.pytorch": pytorch}


Linear.__module__ = LayerNorm.__module__ = RMSNorm.__module__ = "transformer_engine.pytorch.module"
