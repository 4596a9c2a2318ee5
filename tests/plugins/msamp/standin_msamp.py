"""A CPU stand-in for ``msamp`` (MS-AMP 0.4.0), for tests only: MS-AMP needs CUDA and is not on PyPI.

The signatures are MS-AMP's: ``msamp.initialize``, ``msamp.deepspeed.initialize``,
``msamp.optim.LBAdamW``/``LBAdam``, ``msamp.clip_grad_norm_``, ``ScalingTensor`` and ``ScalingMeta``
match ``msamp_signatures.json``,
the manifest read from MS-AMP's source at the commits it names
(``test_msamp.py::test_standin_signatures_match_the_msamp_manifest``). The bodies are this
project's: ``initialize`` refuses what MS-AMP refuses (a non-module, an unknown level, a
non-Adam optimizer) and builds the optimizer the way MS-AMP 0.4 does (the behaviour lowbit must
work around); the DeepSpeed one casts the raw optimizer through the engine module's
``msamp_initialize`` as MS-AMP's engine does, then hands the rest to the real
``deepspeed.initialize``. What lowbit depends on behaves as MS-AMP's does, each rule naming its
file: state dicts hold ``ScalingTensor`` objects (not tensors), LBAdamW keeps its state dtypes
outside ``defaults``, a Linear with ``use_fp32_linear`` is not replaced. Calls are recorded.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import torch
from torch import nn

CALLS: list[tuple[str, dict]] = []
MANIFEST = json.loads((Path(__file__).parent / "msamp_signatures.json").read_text())
opt_levels = ["O1", "O2"]


@dataclasses.dataclass
class QType:
    """msamp/common/dtype/dtypes.py: a name and a number."""

    name: str
    value: int


class Dtypes:
    """The qtypes of msamp/common/dtype/dtypes.py (0.4.0), by the names MS-AMP gives them."""

    kbyte = QType(name="kByte", value=0)
    kint32 = QType(name="kInt32", value=1)
    kfloat32 = QType(name="kFloat32", value=2)
    kfloat16 = QType(name="kFloat16", value=3)
    kbfloat16 = QType(name="kBFloat16", value=4)
    kfloat8_e4m3 = QType(name="kFloat8E4M3", value=5)
    kfloat8_e5m2 = QType(name="kFloat8E5M2", value=6)


_STORAGE = {
    "kFloat16": torch.float16,
    "kFloat8E4M3": torch.uint8,
    "kFloat8E5M2": torch.uint8,
    "kFloat32": torch.float32,
}


class ScalingMeta:
    """msamp/common/tensor/meta.py: the qtype and the scaling tensors of a ScalingTensor."""

    def __init__(self, qtype, scale=None, scale_inv=None, amax=None, window_size=1, group=None):
        self.qtype, self.window_size, self.group = qtype, window_size, group
        self.scale = scale if scale is not None else torch.ones(())
        self.scale_inv = scale_inv if scale_inv is not None else torch.ones(())
        self.amax = amax if amax is not None else torch.zeros((window_size,))
        # Steps of amax seen; scales come from the current tensor (in-time scaling) until it
        # reaches window_size (is_warmup / is_in_time_scaling, meta.py 0.4.0 and main).
        self.amax_counter = torch.zeros((), dtype=torch.int32)

    def is_warmup(self):
        return self.amax_counter < self.window_size


# msamp/optim/optimizer.py (0.4.0 and main): the scaling metas of every FP8Linear (its
# ``scaling_metas``), registered at initialize (model_state.register_scaling_metas); each optimizer
# step rolls their amax windows and counts the step (``_update_scaling_factors``). None of it is
# in a state dict: it lives on the module and in MS-AMP's process-wide model_state.
MODEL_STATE: list[dict[str, ScalingMeta]] = []


def _update_scaling_factors() -> None:
    for metas in MODEL_STATE:
        for name in ("input", "ograd"):
            meta = metas[name]
            finite = bool(torch.isfinite(meta.amax[0]))
            window_max = meta.amax.max() if finite else torch.zeros(())
            meta.scale.copy_(
                torch.where(window_max > 0, torch.exp2(torch.floor(torch.log2(448.0 / window_max))), meta.scale)
            )
            meta.amax.copy_(meta.amax.roll(1))
            meta.amax[0] = 0
            meta.amax_counter.copy_(meta.amax_counter + 1 if finite else torch.zeros_like(meta.amax_counter))


class ScalingTensor:
    """msamp/common/tensor/tensor.py: NOT a torch.Tensor (a Python object holding ``value`` and
    ``meta``), so torch.load(weights_only=True) refuses it; it checks value against the qtype."""

    def __init__(self, value, meta):
        if _STORAGE[meta.qtype.name] != value.dtype:
            raise TypeError(f"stand-in ScalingTensor: {value.dtype} does not store {meta.qtype.name}")
        self.value, self.meta = value, meta

    def float(self) -> torch.Tensor:
        return self.value.float() * self.meta.scale_inv


def _wrapped(tensor: torch.Tensor) -> ScalingTensor:
    """A ScalingTensor around ``tensor``, losslessly: the stand-in trains in fp32, so its weights and
    moments are kFloat32 (MS-AMP's are fp16 weights and, at O2, fp8/fp16 moments). What lowbit meets
    is the same: an object that is not a tensor, with a qtype and scaling tensors."""
    return ScalingTensor(
        tensor.detach().clone(), ScalingMeta(Dtypes.kfloat32, amax=tensor.detach().abs().max().reshape(1))
    )


class FP8Linear(nn.Linear):
    """MS-AMP's FP8Linear keeps its weight as a ScalingParameter (msamp/nn/linear.py, fp16 by
    default): the state dict holds a ScalingTensor under "weight". Its ``scaling_metas`` (input and
    output gradient over a window of 16 steps, weight gradient in time) are plain attributes."""

    DEFAULT_WINDOW_SIZE = 16
    DEFAULT_WGRAD_WINDOW_SIZE = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaling_metas = dict(
            input=ScalingMeta(Dtypes.kfloat8_e4m3, window_size=FP8Linear.DEFAULT_WINDOW_SIZE),
            wgrad=ScalingMeta(Dtypes.kfloat8_e4m3, window_size=FP8Linear.DEFAULT_WGRAD_WINDOW_SIZE),
            ograd=ScalingMeta(Dtypes.kfloat8_e5m2, window_size=FP8Linear.DEFAULT_WINDOW_SIZE),
        )

    def forward(self, x):
        with torch.no_grad():  # the amax of this step's input, as MS-AMP's FP8 GEMM records it
            meta = self.scaling_metas["input"]
            meta.amax[0] = torch.maximum(meta.amax[0], x.detach().abs().max().float())
        return super().forward(x)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = _wrapped(self.weight)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        weight = state_dict.get(prefix + "weight")
        if isinstance(weight, ScalingTensor):
            state_dict[prefix + "weight"] = weight.float()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class LBAdamW(torch.optim.AdamW):
    """msamp/optim/adamw.py and adamw_base.py (0.4.0): the state dtypes and bias correction are
    attributes, not ``defaults`` (MS-AMP's holds lr, betas, eps, weight_decay, amsgrad and maximize;
    the stand-in's also torch's switches, which its step reads), and the keyword-only signature
    refuses anything else (``decoupled_weight_decay`` included). At O2
    the moments are ScalingTensors (uint8 fp8 and fp16)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize: bool = False,
        exp_avg_dtype=torch.uint8,
        exp_avg_sq_dtype=torch.float16,
        tensor_scale=True,
    ):
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize
        )
        self.bias_correction, self.exp_avg_dtype, self.exp_avg_sq_dtype = (
            bias_correction,
            exp_avg_dtype,
            exp_avg_sq_dtype,
        )
        self.use_adam = False

    def step(self, closure=None):
        loss = super().step(closure)
        _update_scaling_factors()
        return loss

    def state_dict(self):
        state = super().state_dict()
        low = {"exp_avg": self.exp_avg_dtype != torch.float32, "exp_avg_sq": self.exp_avg_sq_dtype != torch.float32}
        state["state"] = {
            index: {k: _wrapped(v) if low.get(k) else v for k, v in entry.items()}
            for index, entry in state["state"].items()
        }
        return state

    def load_state_dict(self, state_dict):
        state_dict = {
            **state_dict,
            "state": {
                index: {k: v.float() if isinstance(v, ScalingTensor) else v for k, v in entry.items()}
                for index, entry in state_dict["state"].items()
            },
        }
        super().load_state_dict(state_dict)


class LBAdam(LBAdamW):
    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        maximize: bool = False,
        *args,
        **kwargs,
    ):
        super().__init__(
            params=params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            *args,
            **kwargs,
        )
        self.use_adam = True  # MS-AMP's LBAdam is LBAdamW with L2 (coupled) weight decay


def initialize(model, optimizer=None, opt_level="O1", use_te=False):
    CALLS.append(("initialize", {"opt_level": opt_level, "optimizer": type(optimizer).__name__}))
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"stand-in msamp.initialize: model is a {type(model).__name__}, not an nn.Module")
    if opt_level not in opt_levels:
        raise ValueError(f"stand-in msamp.initialize: opt_level {opt_level!r} is not one of {opt_levels}")
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise ValueError(f"stand-in msamp.initialize: {type(optimizer).__name__} cannot be cast at {opt_level}")
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    order = [index_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            # msamp/nn/linear.py LinearReplacer._replace: a Linear with use_fp32_linear stays.
            if type(child) is nn.Linear and not getattr(child, "use_fp32_linear", False):
                new = FP8Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():  # new parameter objects, as MS-AMP's replacer makes
                    new.weight.copy_(child.weight)
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
                setattr(module, name, new)
                MODEL_STATE.append(new.scaling_metas)
    parameters = list(model.parameters())
    position = 0
    for group in optimizer.param_groups:
        for i in range(len(group["params"])):
            group["params"][i] = parameters[order[position]]
            position += 1
    # The behaviour of MS-AMP 0.4 that lowbit works around: the new optimizer gets the old one's
    # defaults (less the fused/foreach-style switches, plus the state dtypes of the level), so an
    # unknown default key reaches LBAdam; and the Adam check comes before the AdamW one, so a
    # PyTorch whose AdamW subclasses Adam gets LBAdam.
    state_dtypes = {"O1": (torch.float32, torch.float32), "O2": (torch.uint8, torch.float16)}[opt_level]
    switches = ("foreach", "capturable", "differentiable", "fused")
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in switches}
    defaults.update(exp_avg_dtype=state_dtypes[0], exp_avg_sq_dtype=state_dtypes[1])
    cls = LBAdam if isinstance(optimizer, torch.optim.Adam) else LBAdamW
    return model, cls(optimizer.param_groups, **defaults)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    CALLS.append(("clip_grad_norm_", {"max_norm": max_norm}))
    return torch.nn.utils.clip_grad_norm_(
        parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
    )


def deepspeed_initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    config_params=None,
):
    import deepspeed

    CALLS.append(
        ("deepspeed.initialize", {"msamp": dict(config.get("msamp", {})), "zero": config["zero_optimization"]["stage"]})
    )
    plain = {k: v for k, v in config.items() if k != "msamp"}  # the section MSAMPDeepSpeedEngine reads
    section = config.get("msamp", {})
    if section.get("enabled"):
        # MSAMPDeepSpeedEngine._configure_optimizer (msamp/deepspeed/runtime/engine.py) casts the
        # raw client optimizer with the module-level name it imported: `msamp_initialize`.
        engine = sys.modules["msamp.deepspeed.runtime.engine"]
        level = "O2" if section.get("opt_level") == "O3" else section.get("opt_level", "O1")
        model, optimizer = engine.msamp_initialize(model, optimizer, level, section.get("use_te", False))
    return deepspeed.initialize(model=model, optimizer=optimizer, config=plain, dist_init_required=dist_init_required)


class DeepSpeedIntegrationFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import msamp.deepspeed`` as MS-AMP runs it: its package imports
    msamp/deepspeed/runtime/engine.py, whose first lines take ``deepspeed_engine_imports`` (the
    manifest's list, read from v0.4.0 and main) from the REAL ``deepspeed.runtime.engine``. DeepSpeed
    releases without Apex AMP lack ``AMP``/``amp``, so there the import fails as MS-AMP's does."""

    def find_spec(self, fullname, path=None, target=None):
        return (
            importlib.machinery.ModuleSpec(fullname, self, is_package=True) if fullname == "msamp.deepspeed" else None
        )

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import importlib as _importlib

        ds_engine = _importlib.import_module("deepspeed.runtime.engine")
        missing = [name for name in MANIFEST["deepspeed_engine_imports"] if not hasattr(ds_engine, name)]
        if missing:
            raise ImportError(
                f"cannot import name {missing[0]!r} from 'deepspeed.runtime.engine' ({ds_engine.__file__})",
                name="deepspeed.runtime.engine",
                path=ds_engine.__file__,
            )
        engine = types.ModuleType("msamp.deepspeed.runtime.engine")
        engine.msamp_initialize = initialize  # `from msamp import initialize as msamp_initialize`
        sys.modules["msamp.deepspeed.runtime.engine"] = engine
        module.__path__ = []
        module.initialize = deepspeed_initialize
        module.initialize.__name__ = "initialize"


FINDER = DeepSpeedIntegrationFinder()


def install() -> dict[str, types.ModuleType]:
    MODEL_STATE.clear()  # a fresh process
    msamp = types.ModuleType("msamp")
    msamp.__spec__ = importlib.machinery.ModuleSpec("msamp", None, is_package=True)
    msamp.__path__ = []
    msamp.__version__ = "0.4.0"
    msamp.initialize, msamp.clip_grad_norm_, msamp.opt_levels = initialize, clip_grad_norm_, opt_levels
    optim = types.ModuleType("msamp.optim")
    optim.LBAdamW, optim.LBAdam = LBAdamW, LBAdam
    msamp.optim = optim
    common = types.ModuleType("msamp.common")
    common.__path__ = []
    tensor = types.ModuleType("msamp.common.tensor")
    tensor.ScalingTensor, tensor.ScalingMeta = ScalingTensor, ScalingMeta
    dtype = types.ModuleType("msamp.common.dtype")
    dtype.Dtypes = Dtypes
    msamp.common, common.tensor, common.dtype = common, tensor, dtype
    # msamp imports Transformer Engine's pre-2.0 extension module at import time.
    tex = types.ModuleType("transformer_engine_extensions")
    tex.__spec__ = importlib.machinery.ModuleSpec("transformer_engine_extensions", None)
    return {
        "msamp": msamp,
        "msamp.optim": optim,
        "msamp.common": common,
        "msamp.common.tensor": tensor,
        "msamp.common.dtype": dtype,
        "transformer_engine_extensions": tex,
    }
