"""lowbit-msamp: Microsoft MS-AMP as a lowbit FP8 backend (priority 300: first when usable).

``msamp`` is imported only in the hooks that run once MS-AMP has been chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

from lowbit import hookimpl

from lowbit.kernel.plugin_api import (
    BackendDescription,
    BackendUnavailableError,
    HardwareInfo,
    LayerRole,
    PrepareContext,
    StrategyIntegration,
    UnsupportedCombinationError,
    note,
    recipe_launch_hooks,
)

from lowbit_msamp.compat import deepspeed_integration_problem, unmet_requirements
from lowbit_msamp.recipe import MSAMPRecipeKwargs

NAME = "msamp"
PRIORITY = 300
INSTALL_HINT = "MS-AMP is installed from its source repository, see plugins/fp8_msamp/README.md"
ADAM_NAMES = ("Adam", "AdamW", "FusedAdam")


def unavailable_reason(hardware: HardwareInfo) -> str:
    problem = hardware.fp8_gemm_problem()
    if problem:  # what this machine lacks comes first: installing MS-AMP would not help here
        installed = importlib.util.find_spec("msamp") is not None
        return f"MS-AMP {problem}" + ("" if installed else f" (and msamp is not installed: {INSTALL_HINT})")
    if importlib.util.find_spec("msamp") is None:
        return f"msamp not importable: not installed ({INSTALL_HINT})"
    unmet = unmet_requirements()
    if unmet:
        return "MS-AMP cannot run with what is installed here: " + "; ".join(unmet)
    # `import msamp` imports both; without them it fails in prepare(), after winning the ranking.
    if importlib.util.find_spec("transformer_engine_extensions") is None:
        return (
            "msamp not importable here: it imports transformer_engine_extensions, the extension module of the "
            "Transformer Engine it pins (2023); Transformer Engine 2.x no longer has it"
        )
    if importlib.util.find_spec("deepspeed") is None:
        return "msamp not importable here: it imports deepspeed (MS-AMP pins deepspeed==0.13.1)"
    return ""


@hookimpl
def describe_backend(hardware: HardwareInfo) -> BackendDescription:
    reason = unavailable_reason(hardware)
    # Read from source files only where MS-AMP could otherwise run, so discovery elsewhere stays free.
    under_deepspeed = "" if reason else deepspeed_integration_problem()
    return BackendDescription(
        name=NAME,
        priority=PRIORITY,
        available=not reason,
        reason=reason,
        unusable_under={"deepspeed": under_deepspeed} if under_deepspeed else {},
        options_class=MSAMPRecipeKwargs,
        aliases=("ms-amp", "ms_amp"),
        libraries=("MS-AMP",),
        # msamp.initialize keeps the converted Linears' weights as fp16 ScalingTensors
        # (LinearReplacer.replace's weight_qtype default), so they round to fp16 at conversion.
        weight_storage="float16",
        # The converted Linears' weights as fp16 ScalingTensors (above); the rest is counted as fp32
        # by `lowbit estimate-memory` (O2's low-bit optimizer states are not modelled there).
        memory_per_parameter={"weights": 2.0},
    )


def _import_msamp():
    try:
        import msamp
    except Exception as exc:  # noqa: BLE001 - its CUDA extensions fail to load in many ways
        raise BackendUnavailableError(f"msamp not importable: {type(exc).__name__}: {exc}") from None
    return msamp


def zero_stage(options: dict) -> int:
    """The ZeRO stage a DeepSpeed run will use, from the section key or the config it names."""
    if "zero_stage" in options:
        return int(options["zero_stage"])
    config = options.get("config")
    if config is None and options.get("deepspeed_config_file"):
        config = json.loads(Path(options["deepspeed_config_file"]).read_text())
    return int((config or {}).get("zero_optimization", {}).get("stage", 0))


@hookimpl
def check_compatibility(context: PrepareContext) -> None:
    if context.parallelism is not None and context.parallelism.tp_enabled:
        raise UnsupportedCombinationError(
            f"tp_size={context.parallelism.tp_size}: MS-AMP's ScalingTensor weights cannot be split over "
            "tensor-parallel "
            "ranks. Use the ao backend (fp8_config backend: ao) for FP8 with tensor parallelism."
        )
    if context.strategy == "fsdp":
        raise UnsupportedCombinationError(
            "MS-AMP does not support PyTorch FSDP2 through lowbit. Use DDP, or DeepSpeed ZeRO-1/2 "
            "(--use_deepspeed --zero_stage 2), or another FP8 backend (backend='te' or 'ao') with FSDP."
        )
    if context.strategy == "deepspeed" and zero_stage(context.strategy_options) == 3:
        raise UnsupportedCombinationError(
            "ZeRO-3 is not supported by MS-AMP (its DeepSpeed integration covers ZeRO stages 1 and 2). "
            "Use zero_stage 1 or 2, or another FP8 backend (backend='te' or 'ao') with ZeRO-3."
        )


@hookimpl
def prepare_model_and_optimizer(model, optimizer, context: PrepareContext, layer_roles):
    if optimizer is None:
        raise UnsupportedCombinationError(
            "MS-AMP converts the model and its optimizer together (msamp.initialize), so prepare() needs both "
            "in the same call: `model, optimizer = accelerator.prepare(model, optimizer)` (dataloaders and "
            "schedulers may come in the same call or later)."
        )
    level = context.backend_options.opt_level
    if type(optimizer).__name__ not in ADAM_NAMES:
        raise UnsupportedCombinationError(
            f"MS-AMP {level} works with Adam and AdamW only (it keeps their states in FP8/FP16); got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}. Use torch.optim.AdamW, or opt_level O1 "
            "with another backend."
        )
    keep_tied_linears_high_precision(model)
    keep_lora_layers_high_precision(model, layer_roles)
    if context.strategy == "deepspeed":
        return model, optimizer  # msamp.deepspeed.initialize converts both (strategy_integration)
    return initialize(_import_msamp(), model, optimizer, level)


def keep_lora_layers_high_precision(model, layer_roles) -> list[str]:
    """Adapters are never converted; a frozen base is left too, and said: MS-AMP's FP8Linear
    computes a weight gradient for every layer it converts (its ``_FP8GemmFunction.backward``,
    ``msamp/nn/functional.py``, 0.4.0 and main), so a frozen base would pay that GEMM and keep an
    FP8 master weight it never updates. A layer published in FP8 is refused by name."""
    published = layer_roles.named(LayerRole.FP8_PUBLISHED)
    if published:
        raise UnsupportedCombinationError(
            f"lowbit-msamp cannot run layers published in FP8 ({len(published)}, the first: {published[0]}): "
            "MS-AMP would convert their FP8 data as if it were high-precision weights. Use the ao backend "
            "(AORecipeKwargs()), which runs them with their own scales, or load the checkpoint in bf16."
        )
    frozen = layer_roles.named(LayerRole.FROZEN_BASE)
    for name in [*layer_roles.named(LayerRole.ADAPTER), *frozen]:
        model.get_submodule(name).use_fp32_linear = True  # MS-AMP's own "leave this Linear" mark
    if frozen:
        note(
            f"lowbit-msamp keeps {len(frozen)} frozen base(s) in high precision: MS-AMP computes a weight gradient "
            "for every layer it converts. For frozen bases in FP8 (two GEMMs a step, half the memory), use the ao "
            "backend (AORecipeKwargs())."
        )
    return frozen


def keep_tied_linears_high_precision(model) -> list[str]:
    """Mark Linear layers whose weight another module shares (a head tied to the embedding) for
    MS-AMP to leave alone: its replacer builds a new FP8Linear with a new fp16 ScalingParameter
    (``msamp/nn/linear.py`` ``LinearReplacer._build_fp8linear``), which would untie them and
    leave the embedding untrained. MS-AMP skips a Linear with ``use_fp32_linear`` set
    (``LinearReplacer._replace``, 0.4.0 and main)."""
    from torch import nn

    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    tied = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and len(set(owners.get(id(module.weight), []))) > 1:
            module.use_fp32_linear = True
            tied.append(name)
    return tied


def initialize(msamp, model, optimizer, level: str, use_te: bool = False):
    """``msamp.initialize``, made right for PyTorch releases newer than MS-AMP 0.4.

    MS-AMP passes every default of the optimizer to its LBAdam/LBAdamW, which do not take
    ``decoupled_weight_decay`` (a default of Adam and AdamW in current PyTorch: TypeError); and it
    tests ``isinstance(optimizer, Adam)`` first, which a current AdamW also is, so an AdamW would
    silently become LBAdam (L2 weight decay instead of decoupled). lowbit removes the key before
    the call and, for a decoupled optimizer given LBAdam, builds MS-AMP's LBAdamW on the same
    converted parameter groups, with the state dtypes and bias correction MS-AMP gave LBAdam:
    those live in attributes, not in ``defaults`` (``msamp/optim/adamw_base.py``), so rebuilding
    from ``defaults`` alone would give O1 the O2 states (uint8 and fp16 moments).
    """
    import inspect

    import torch

    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay"))
    optimizer.defaults.pop("decoupled_weight_decay", None)
    model, cast = msamp.initialize(model, optimizer, opt_level=level, use_te=use_te)
    if decoupled and getattr(cast, "use_adam", False):
        accepted = inspect.signature(msamp.optim.LBAdamW).parameters
        kwargs = {k: v for k, v in cast.defaults.items() if k in accepted}
        kwargs.update(
            exp_avg_dtype=cast.exp_avg_dtype,
            exp_avg_sq_dtype=cast.exp_avg_sq_dtype,
            bias_correction=cast.bias_correction,
        )
        cast = msamp.optim.LBAdamW(cast.param_groups, **kwargs)
    return model, cast


def deepspeed_initialize(msamp):
    """``msamp.deepspeed.initialize`` with lowbit's :func:`initialize` in place of MS-AMP's: its
    engine casts the raw client optimizer (``MSAMPDeepSpeedEngine._configure_optimizer`` calls
    ``msamp_initialize``, msamp/deepspeed/runtime/engine.py), so a current AdamW would raise
    TypeError there, or become LBAdam."""
    import importlib

    engine = importlib.import_module("msamp.deepspeed.runtime.engine")

    def corrected(model, optimizer=None, opt_level="O1", use_te=False):
        return initialize(msamp, model, optimizer, opt_level, use_te)

    def run(*args, **kwargs):
        original = engine.msamp_initialize
        engine.msamp_initialize = corrected
        try:
            return msamp.deepspeed.initialize(*args, **kwargs)
        finally:
            engine.msamp_initialize = original

    return run


@hookimpl
def strategy_integration(strategy: str, context: PrepareContext):
    if strategy != "deepspeed":
        return None
    msamp = _import_msamp()
    try:
        importlib.import_module("msamp.deepspeed")  # its DeepSpeed integration, a subpackage
    except ImportError as exc:  # what deepspeed_integration_problem could not see coming (a changed source)
        raise BackendUnavailableError(
            f"MS-AMP cannot run under DeepSpeed here: `import msamp.deepspeed` failed: "
            f"{type(exc).__name__}: {exc}. Use backend 'te' or 'ao' with DeepSpeed."
        ) from None
    return StrategyIntegration(
        initialize=deepspeed_initialize(msamp),
        config={"msamp": {"enabled": True, "opt_level": context.backend_options.opt_level}},
    )


@hookimpl
def clip_grad_norm(parameters, max_norm, norm_type, context: PrepareContext):
    msamp = _import_msamp()
    return msamp.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def _plain(value):
    # MS-AMP keeps FP8 weights as ScalingTensor (it has .meta); .float() dequantizes it.
    return value.float() if hasattr(value, "meta") else value


@hookimpl
def encode_checkpoint_state(kind, owner, state, context: PrepareContext):
    from lowbit_msamp.state import encode

    return encode(state)


@hookimpl
def decode_checkpoint_state(kind, owner, state, context: PrepareContext):
    from lowbit_msamp.state import decode, device_of

    return decode(state, _import_msamp(), device_of(owner))


@hookimpl
def backend_checkpoint_state(model, context: PrepareContext):
    from lowbit_msamp.state import scaling_metas_state

    return scaling_metas_state(model) or None


@hookimpl
def load_backend_checkpoint_state(model, state, context: PrepareContext):
    from lowbit_msamp.state import load_scaling_metas_state

    load_scaling_metas_state(model, state)
    return True


@hookimpl
def export_state_dict(model, state_dict, context: PrepareContext):
    return {k: _plain(v) for k, v in state_dict.items()}


add_launch_arguments, launch_environment = recipe_launch_hooks(MSAMPRecipeKwargs, "fp8 backend msamp (MS-AMP)")
