"""A CPU stand-in for ``msamp`` (MS-AMP 0.4.0), for tests only: MS-AMP needs CUDA and is not on PyPI.

Only the signatures are MS-AMP's: ``msamp.initialize``, ``msamp.deepspeed.initialize``,
``msamp.optim.LBAdamW``/``LBAdam`` and ``msamp.clip_grad_norm_`` match ``msamp_signatures.json``,
the manifest read from MS-AMP's source at the commits it names
(``test_msamp.py::test_standin_signatures_match_the_msamp_manifest``). The bodies are this
project's: ``initialize`` refuses what MS-AMP refuses (a non-module, an unknown level, a
non-Adam optimizer) and builds the optimizer the way MS-AMP 0.4 does (the behaviour lowbit must
work around); the DeepSpeed one records the config and hands the rest to the real
``deepspeed.initialize``. Calls are recorded.
"""
from __future__ import annotations

import importlib.machinery
import types

import torch
from torch import nn

CALLS: list[tuple[str, dict]] = []
opt_levels = ["O1", "O2"]


class FP8Linear(nn.Linear):
    """Marks a converted layer; MS-AMP's real one holds ScalingTensor weights."""


class LBAdamW(torch.optim.AdamW):
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
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype


class LBAdam(LBAdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, maximize: bool = False, *args, **kwargs):
        super().__init__(params=params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, *args, **kwargs)
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
            if type(child) is nn.Linear:
                new = FP8Linear(child.in_features, child.out_features, bias=child.bias is not None)
                new.load_state_dict(child.state_dict())  # new parameter objects, as MS-AMP's replacer makes
                setattr(module, name, new)
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
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)


def deepspeed_initialize(
    args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
    mpu=None, dist_init_required=None, collate_fn=None, config=None, config_params=None,
):
    import deepspeed

    CALLS.append(("deepspeed.initialize", {"msamp": dict(config.get("msamp", {})), "zero": config["zero_optimization"]["stage"]}))
    plain = {k: v for k, v in config.items() if k != "msamp"}  # the section MSAMPDeepSpeedEngine reads
    return deepspeed.initialize(model=model, optimizer=optimizer, config=plain, dist_init_required=dist_init_required)


def install() -> dict[str, types.ModuleType]:
    msamp = types.ModuleType("msamp")
    msamp.__spec__ = importlib.machinery.ModuleSpec("msamp", None, is_package=True)
    msamp.__path__ = []
    msamp.__version__ = "0.4.0"
    msamp.initialize, msamp.clip_grad_norm_, msamp.opt_levels = initialize, clip_grad_norm_, opt_levels
    optim = types.ModuleType("msamp.optim")
    optim.LBAdamW, optim.LBAdam = LBAdamW, LBAdam
    ds = types.ModuleType("msamp.deepspeed")
    ds.initialize = deepspeed_initialize
    ds.initialize.__name__ = "initialize"
    msamp.optim, msamp.deepspeed = optim, ds
    # msamp imports Transformer Engine's pre-2.0 extension module at import time.
    tex = types.ModuleType("transformer_engine_extensions")
    tex.__spec__ = importlib.machinery.ModuleSpec("transformer_engine_extensions", None)
    return {"msamp": msamp, "msamp.optim": optim, "msamp.deepspeed": ds, "transformer_engine_extensions": tex}
