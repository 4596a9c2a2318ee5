"""A CPU stand-in for ``transformer_engine``, for tests only (TE needs CUDA to import).

Every constructor and function lowbit-te calls has the exact signature of TE 2.20
(``test_te.py::test_standin_signatures_match_the_real_te`` checks them against the wheel's
source). ``transformer_engine.common.recipe`` is the REAL module, loaded from the wheel.
Calls are recorded so tests can see what reached TE. Behaviour lowbit depends on is TE's, read
from the wheels (each rule names its file and release): FP8 metadata created at the first
forward under autocast, ``_extra_state`` pickling with the recipe (refused on load by 2.20,
unpickled by 2.9), the GEMM dimension rule, new Parameters made by every constructor, and
activation recompute (``te.distributed.checkpoint``) with its per-process buffer of scales.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.machinery
import math
import os
import pickle
import types
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import functional as F

AUTOCAST_CALLS: list[dict[str, Any]] = []
CAPABILITY = {
    "fp8": (True, ""),
    "mxfp8": (False, "stand-in verdict: no MXFP8 GEMMs on this GPU"),
    "block": (True, ""),
    "nvfp4": (False, "stand-in verdict: no NVFP4 GEMMs on this GPU"),
}
# The release whose behaviour the stand-in has where releases differ (set_extra_state); tests
# switch it to "2.9.0", the oldest release lowbit-te accepts.
RELEASE = {"version": "2.20.2"}
# FP8GlobalStateManager's answer inside and outside te.autocast (pytorch/quantization.py).
FP8_STATE: dict[str, Any] = {"enabled": False, "recipe": None}
UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
RECIPE_MODULE: dict[str, Any] = {}  # the real transformer_engine.common.recipe, set by install()
# Activation recompute (te.distributed.checkpoint), per process as in TE: the region flag is on
# during a checkpointed forward, the phase flag during its recompute in backward
# (pytorch/distributed.py _IN_ACTIVATION_RECOMPUTE_REGION / _ACTIVATION_RECOMPUTE_PHASE, 2.9.0 and
# 2.20.2); the buffer is FP8GlobalStateManager's fp8_tensors_recompute_buffer (pytorch/quantization.py
# 2.20.2, fp8.py 2.9.0), a list that a fresh process starts empty (install() empties it).
RECOMPUTE: dict[str, Any] = {"region": False, "phase": False}
RECOMPUTE_BUFFER: list[collections.deque] = []
RECOMPUTE_KEY = "global_fp8_buffer_pos_fwd_recompute"


def _check_fp8_gemm_dims(inp: torch.Tensor, weight: torch.Tensor, recipe: Any) -> None:
    """What TE checks before an FP8 GEMM. pytorch/utils.py ``assert_dim_for_fp8_exec`` (2.9.0 and
    2.20.2; called from module/linear.py's forward when fp8 is on): for the input and the weight,
    the product of the leading dims divisible by 8 and the last dim by 16 (2.20.2 raises
    ValueError, 2.9.0 asserts). MXFP8 scales 32-element blocks along both axes
    (constants.py ``MXFP8_BLOCK_SCALING_SIZE = 32``, tensor/mxfp8_tensor.py ``is_quantizable``).
    NVFP4 quantizes 16-element blocks and only tensors whose leading dims and last dim are
    multiples of 16 (constants.py ``NVFP4_BLOCK_SCALING_SIZE = 16``, tensor/nvfp4_tensor.py
    ``NVFP4Quantizer.is_quantizable``, 2.20.2; the CUDA kernel behind it is not in the wheel's
    Python, so the stand-in refuses what ``is_quantizable`` rejects)."""
    multiples = (8, 16)
    if recipe is not None and recipe.mxfp8():
        multiples = (32, 32)
    elif recipe is not None and recipe.nvfp4():
        multiples = (16, 16)
    for tensor in (inp, weight):
        leading = math.prod(tensor.shape[:-1])
        if leading % multiples[0] or tensor.shape[-1] % multiples[1]:
            raise ValueError(
                f"stand-in TE: an FP8 GEMM operand of dims {list(tensor.shape)} has {leading} rows (needs a "
                f"multiple of {multiples[0]}) and {tensor.shape[-1]} columns (needs a multiple of {multiples[1]})"
            )


class _DelayedScalingState:
    """TE's DelayedScalingRecipeState (pytorch/quantization.py, 2.20.2): a scale per quantized
    tensor and an amax history of ``amax_history_len`` rows."""

    def __init__(self, recipe: Any, num_quantizers: int) -> None:
        self.scale = torch.ones(num_quantizers)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers)


class _StatelessState:
    """Current, block, MXFP8 and NVFP4 recipe states: nothing TE checkpoints."""


class _TEBaseModule(nn.Module):
    """TransformerEngineBaseModule (pytorch/module/base.py, 2.20.2): FP8 metadata set up at the
    first forward under autocast, and ``_extra_state`` holding it, pickled with the recipe."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8_meta: dict[str, Any] = {"fp8_checkpoint": False, "fp8_group": None, "recipe": None}
        self.fp8 = self.fp8_calibration = self.fp8_initialized = self.fp8_meta_tensors_initialized = False

    def init_fp8_meta_tensors(self, recipe: Any) -> None:
        for key, per_gemm in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            current = self.fp8_meta.get(key)
            if self.fp8_meta_tensors_initialized and recipe.delayed() and isinstance(current, _DelayedScalingState):
                continue  # TE keeps the state (adjusting only the history length)
            count = self.fp8_meta["num_gemms"] * per_gemm
            self.fp8_meta[key] = _DelayedScalingState(recipe, count) if recipe.delayed() else _StatelessState()
        self.fp8_meta_tensors_initialized = True

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        self.fp8 = FP8_STATE["enabled"]
        self.fp8_meta["fp8_checkpoint"] = self.fp8
        if not self.fp8:
            self.fp8_initialized = False
            return
        recipe = FP8_STATE["recipe"]
        if self.fp8_initialized and recipe == self.fp8_meta["recipe"]:
            return
        self.fp8_meta.update(
            recipe=recipe,
            num_gemms=num_gemms,
            fp8_max_fwd=recipe.fp8_format.value.max_fwd,
            fp8_max_bwd=recipe.fp8_format.value.max_bwd,
        )
        self.init_fp8_meta_tensors(recipe)
        self.fp8_initialized = True

    def get_extra_state(self) -> torch.Tensor:
        meta = self.fp8_meta
        if not (meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration):
            return torch.empty(0, dtype=torch.uint8)  # e.g. after a forward outside autocast (eval)
        if not isinstance(meta.get("scaling_fwd"), _DelayedScalingState):
            return torch.empty(0, dtype=torch.uint8)  # stateless recipe
        state = {
            "recipe": meta["recipe"],
            "scale_fwd": meta["scaling_fwd"].scale.clone(),
            "amax_history_fwd": meta["scaling_fwd"].amax_history.clone(),
            "scale_bwd": meta["scaling_bwd"].scale.clone(),
            "amax_history_bwd": meta["scaling_bwd"].amax_history.clone(),
            "extra_fp8_variables": {
                k: v
                for k, v in meta.items()
                if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str, tuple, list))
            },
        }
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        if state is None or state.numel() == 0:
            return
        data = state.detach().cpu().numpy().tobytes()
        # 2.20.2 (pytorch/_extra_state.py): a delayed-scaling pickle is refused unless the unsafe
        # opt-in is set; 2.9.0 (module/base.py): unpickled, whatever it holds.
        if RELEASE["version"] != "2.9.0" and os.environ.get(UNSAFE_PICKLE_ENV, "0") != "1":
            raise RuntimeError(
                f"stand-in TE {RELEASE['version']}: refusing to unpickle the extra state of "
                f"{type(self).__name__} (set {UNSAFE_PICKLE_ENV}=1 to allow it)"
            )
        loaded = pickle.loads(data)
        self.fp8_meta.update(loaded["extra_fp8_variables"])
        self.fp8_meta["recipe"] = loaded["recipe"]
        self.fp8_meta.pop(RECOMPUTE_KEY, None)  # an index into this process's buffer: TE drops it
        self.init_fp8_meta_tensors(loaded["recipe"])
        for key, mode in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
            self.fp8_meta[mode].scale.copy_(loaded[f"scale_{key}"])
            self.fp8_meta[mode].amax_history.copy_(loaded[f"amax_history_{key}"])


class Linear(_TEBaseModule):
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
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
            if bias
            else torch.Tensor().to(dtype=dtype, device=device)
        )
        nn.init.normal_(self.weight)

    def forward(self, x):
        recomputing = self.fp8 and RECOMPUTE["phase"]
        if recomputing:  # module/base.py prepare_forward: the second forward reuses the first's scales
            _scales_for_recompute(self.fp8_meta)
        else:
            self.init_fp8_metadata(num_gemms=1)
            if self.fp8 and RECOMPUTE["region"]:
                _stash_scales_for_recompute(self.fp8_meta)
        if self.fp8:
            _check_fp8_gemm_dims(x, self.weight, self.fp8_meta["recipe"])
            state = self.fp8_meta["scaling_fwd"]
            if isinstance(state, _DelayedScalingState):  # record amaxes, as TE's quantizers do
                with torch.no_grad():
                    state.amax_history[0, 0] = torch.maximum(state.amax_history[0, 0], x.detach().abs().max().float())
                    state.amax_history[0, 1] = self.weight.detach().abs().max().float()
        out = F.linear(x, self.weight, self.bias if self.use_bias else None)
        if recomputing and isinstance(self.fp8_meta.get("scaling_fwd"), _DelayedScalingState):  # end_forward
            self.fp8_meta["scaling_fwd"].amax_history.copy_(self.fp8_meta["updated_amax_history_fwd"])
            self.fp8_meta["scaling_fwd"].scale.copy_(self.fp8_meta["updated_scale_fwd"])
        return out


def _stash_scales_for_recompute(meta: dict[str, Any]) -> None:
    """FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute (quantization.py 2.20.2):
    delayed scaling only; the module's slot in the process-wide buffer is kept in its fp8_meta."""
    if not isinstance(meta.get("scaling_fwd"), _DelayedScalingState):
        return
    stash = [meta["scaling_fwd"].amax_history.clone(), meta["scaling_fwd"].scale.clone()]
    if RECOMPUTE_KEY in meta:
        RECOMPUTE_BUFFER[meta[RECOMPUTE_KEY]].append(stash)  # IndexError when the slot is another process's
    else:
        RECOMPUTE_BUFFER.append(collections.deque([stash]))
        meta[RECOMPUTE_KEY] = len(RECOMPUTE_BUFFER) - 1


def _scales_for_recompute(meta: dict[str, Any]) -> None:
    """FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute (quantization.py 2.20.2)."""
    if not isinstance(meta.get("scaling_fwd"), _DelayedScalingState):
        return
    meta["updated_amax_history_fwd"] = meta["scaling_fwd"].amax_history.clone()
    meta["updated_scale_fwd"] = meta["scaling_fwd"].scale.clone()
    history, scale = RECOMPUTE_BUFFER[meta[RECOMPUTE_KEY]].popleft()
    meta["scaling_fwd"].amax_history.copy_(history)
    meta["scaling_fwd"].scale.copy_(scale)


class _Norm(nn.Module):
    """TE's LayerNorm and RMSNorm share this constructor signature. In TE 2.x they are fusible
    operations (pytorch/ops/op.py) with no quantizer of their own: their extra state is empty."""

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

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        self.loaded_extra_state = state


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
        self.record = {
            "enabled": enabled,
            "recipe": recipe,
            "amax_reduction_group": amax_reduction_group,
            "api": "autocast",
        }

    def __enter__(self):
        AUTOCAST_CALLS.append(self.record)
        self._outer = dict(FP8_STATE)
        # TE's default recipe when none is given is DelayedScaling() (quantization.py get_default_fp8_recipe)
        FP8_STATE.update(
            enabled=self.record["enabled"], recipe=self.record["recipe"] or RECIPE_MODULE["module"].DelayedScaling()
        )
        return self

    def __exit__(self, *exc):
        FP8_STATE.update(self._outer)
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


def checkpoint(
    function: Callable,
    *args: Tuple[torch.Tensor, ...],
    **kwargs: Dict[str, Any],
) -> Tuple[torch.Tensor, ...]:
    """te.distributed.checkpoint (pytorch/distributed.py, 2.20.2): the forward runs in the recompute
    region, and the recompute in backward runs in the recompute phase under the forward's FP8
    settings. Built on torch's non-reentrant checkpoint (TE's reentrant default recomputes the same
    way for what the stand-in models)."""
    for name in ("use_reentrant", "distribute_saved_activations", "tp_group", "get_rng_state_tracker"):
        kwargs.pop(name, None)
    forward_fp8 = dict(FP8_STATE)

    @contextlib.contextmanager
    def forward_region():
        RECOMPUTE["region"] = True
        try:
            yield
        finally:
            RECOMPUTE["region"] = False

    @contextlib.contextmanager
    def recompute_phase():
        outer = dict(FP8_STATE)
        FP8_STATE.update(forward_fp8)
        RECOMPUTE["phase"] = True
        try:
            yield
        finally:
            RECOMPUTE["phase"] = False
            FP8_STATE.update(outer)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=lambda: (forward_region(), recompute_phase()), **kwargs
    )


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return CAPABILITY["fp8"] if return_reason else CAPABILITY["fp8"][0]


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return CAPABILITY["mxfp8"] if return_reason else CAPABILITY["mxfp8"][0]


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return CAPABILITY["block"] if return_reason else CAPABILITY["block"][0]


def is_nvfp4_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return CAPABILITY["nvfp4"] if return_reason else CAPABILITY["nvfp4"][0]


def install(recipe_module: types.ModuleType) -> dict[str, types.ModuleType]:
    """Modules to put in ``sys.modules`` (the test uses monkeypatch.setitem on each)."""
    RECIPE_MODULE["module"] = recipe_module
    FP8_STATE.update(enabled=False, recipe=None)
    RECOMPUTE.update(region=False, phase=False)
    RECOMPUTE_BUFFER.clear()  # a fresh process
    te = types.ModuleType("transformer_engine")
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    te.__path__ = []
    te.__version__ = "2.20.2"
    common = types.ModuleType("transformer_engine.common")
    common.__path__ = []
    common.recipe = recipe_module
    pytorch = types.ModuleType("transformer_engine.pytorch")
    for obj in (
        Linear,
        LayerNorm,
        RMSNorm,
        autocast,
        fp8_autocast,
        is_fp8_available,
        is_mxfp8_available,
        is_fp8_block_scaling_available,
        is_nvfp4_available,
    ):
        setattr(pytorch, obj.__name__, obj)
    distributed = types.ModuleType("transformer_engine.pytorch.distributed")
    distributed.checkpoint = checkpoint
    pytorch.distributed = distributed
    te.common, te.pytorch = common, pytorch
    # The PyTorch extension, a distribution of its own (transformer_engine_torch); lowbit-te looks for it.
    extension = types.ModuleType("transformer_engine_torch")
    extension.__spec__ = importlib.machinery.ModuleSpec("transformer_engine_torch", None)
    return {
        "transformer_engine": te,
        "transformer_engine_torch": extension,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe_module,
        "transformer_engine.pytorch": pytorch,
        "transformer_engine.pytorch.distributed": distributed,
    }


Linear.__module__ = LayerNorm.__module__ = RMSNorm.__module__ = "transformer_engine.pytorch.module"
