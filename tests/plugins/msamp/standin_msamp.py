"""A CPU stand-in for ``msamp`` (MS-AMP 0.4.0), for tests only: MS-AMP needs CUDA and is not on PyPI.

Signatures are copied from Azure/MS-AMP: ``msamp/__init__.py`` (``initialize``),
``msamp/deepspeed/__init__.py`` (``initialize``), ``msamp/optim/adamw.py`` (``LBAdamW``),
``msamp/optim/adam.py`` (``LBAdam``) and ``msamp/nn/clip_grad.py`` (``clip_grad_norm_``).
``initialize`` keeps MS-AMP's own checks (levels, optimizer types); the DeepSpeed one records
the config and hands the rest to the real ``deepspeed.initialize``. Calls are recorded.
"""
from __future__ import annotations

import importlib.machinery
import types

import torch
from torch import nn

CALLS: list[tuple[str, dict]] = []
opt_levels = ["O1", "O2"]


class Dtypes:  # msamp.common.dtype.Dtypes, the one member used as a default
    kfloat16 = "kfloat16"


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


def initialize(model, optimizer=None, opt_level="O1", use_te=False, weight_qtype=Dtypes.kfloat16, use_fsdp=False):
    CALLS.append(("initialize", {"opt_level": opt_level, "optimizer": type(optimizer).__name__}))
    if not isinstance(model, torch.nn.Module):
        raise ValueError("Model must be an instance of torch.nn.Module")
    if opt_level not in opt_levels:
        raise ValueError("Invalid optimization level. Please choose from {}".format(opt_levels))
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise ValueError("Optimizer {} is not supported in optimization level {}".format(optimizer, opt_level))
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
    # As MS-AMP 0.4.0 does: the optimizer's own defaults, four keys dropped, and Adam tested first
    # (so a PyTorch whose AdamW subclasses Adam gets LBAdam, and an unknown default key is passed on).
    defaults = optimizer.defaults
    defaults["exp_avg_dtype"] = torch.uint8 if opt_level == "O2" else torch.float32
    defaults["exp_avg_sq_dtype"] = torch.float16 if opt_level == "O2" else torch.float32
    for k in ["foreach", "capturable", "differentiable", "fused"]:
        defaults.pop(k, None)
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
