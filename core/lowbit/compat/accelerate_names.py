"""Accelerate's own names, mapped to what lowbit calls them: the one place of the core that names
plugins (a test keeps every other core module from doing so).

Accelerate names its FP8 backends (``fp8_backend: TE | MSAMP | AO``, ``TERecipeKwargs``, ...) and
its distributed types (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``, ``DEEPSPEED``); a script or
config file written for Accelerate uses those names, and lowbit must say which distribution to
install when the plugin behind one is absent. Which plugin *is* chosen is never decided here:
plugins describe themselves (``describe_backend``), and the core asks them.
"""
from __future__ import annotations

import enum


# The distributed types Accelerate runs on one process when there is only one.
SINGLE_PROCESS_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")
# Accelerate's config sections whose strategy is a separately installed lowbit plugin -> that plugin.
FIRST_PARTY_SECTIONS = {"deepspeed_config": "deepspeed"}

# The backends behind Accelerate's names -> (distribution, folder in a lowbit checkout)
FIRST_PARTY = {
    "msamp": ("lowbit-msamp", "plugins/fp8_msamp"),
    "te": ("lowbit-te", "plugins/fp8_te"),
    "ao": ("lowbit-ao", "plugins/fp8_ao"),
    "deepspeed": ("lowbit-deepspeed", "plugins/dist_deepspeed"),
}

# fp8_config keys that only a first-party backend's recipe defines (the keys Accelerate documents
# are always accepted). tests/test_config.py keeps this in step with the plugins' recipe classes.
PLUGIN_ONLY_FP8_KEYS = {
    "recipe": ("ao", "te"),
    "pad_inner_dim": ("ao",),
    "enable_fsdp_float8_all_gather": ("ao",),
    "force_recompute_fp8_weight_in_bwd": ("ao",),
    "emulate": ("ao",),
    "emulation": ("ao",),
    "optimizer_states": ("ao",),
    "keep_first_last_high_precision": ("ao", "te"),
    "pad_tokens": ("te",),
    "mx_scale_rounding": ("ao",),
    "fp4_last_layers_bf16": ("ao", "te"),
    "nvfp4_random_hadamard": ("ao", "te"),
    "nvfp4_stochastic_rounding": ("ao", "te"),
    "nvfp4_2d_weight_scaling": ("ao", "te"),
}

# The recipes (lowbit.config.recipe_names) each first-party backend offers, so an error can name
# the distribution to install for a recipe no installed backend has. tests/test_recipes.py keeps
# this in step with the plugins' own declarations.
FIRST_PARTY_RECIPES = {
    "ao": ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "nvfp4"),
    "te": ("delayed", "current", "block", "mxfp8", "nvfp4"),
}


# How the strategies lowbit ships (and DeepSpeed's ZeRO stages) spread one process's training
# memory, for `lowbit estimate-memory`: which of (weights, gradients, optimizer states) they divide
# by the ranks, and the buffers they add ("buckets": DDP's gradient buckets, a second copy of the
# gradients; "block": one block's parameters unsharded while it computes; "gradients": FSDP2's
# unsharded gradients waiting for their reduce-scatter, all of them over gloo as measured on CPU).
STRATEGY_MEMORY = {
    "ddp": ((False, False, False), ("buckets",)),
    "fsdp": ((True, True, True), ("block", "gradients")),
    "zero1": ((False, False, True), ()),
    "zero2": ((False, True, True), ()),
    "zero3": ((True, True, True), ("block",)),
}
STRATEGY_MEMORY_NOTE = ("buffers: DDP's gradient buckets; FSDP2/ZeRO-3's one unsharded block; FSDP2's unsharded "
                        "gradients wait for reduce-scatters that run asynchronously, so its buffers and peak are a range "
                        "(none of them alive to all of them). Measured on CPU within 15% (of the range, for FSDP2) for "
                        "DDP and FSDP2 in fp32, and DDP in bf16 and fp8 (ao) (tests/test_estimate_memory.py); ZeRO, te, msamp "
                        "and low-bit optimizer states are not measured.")


def install_command(backend: str) -> str:
    """How to install a first-party plugin, from PyPI and from a lowbit checkout."""
    distribution, folder = FIRST_PARTY[backend]
    return f"`pip install {distribution}` (from a lowbit checkout: `pip install -e {folder}`)"


def first_party_recipe_offers(recipe: str) -> list[tuple[str, str]]:
    """(backend, how to install it) for each first-party backend that offers ``recipe``."""
    return [(backend, install_command(backend)) for backend, names in FIRST_PARTY_RECIPES.items() if recipe in names]


# Accelerate's distributed type for "data parallel on this device type".
_DATA_PARALLEL_BY_DEVICE = {"cuda": "MULTI_GPU", "cpu": "MULTI_CPU"}


def reported_distributed_type(reports_as: str, device_type: str) -> str:
    """A strategy's ``reports_as`` as Accelerate reports it on this device: its MULTI_GPU is
    MULTI_CPU on a CPU."""
    if reports_as in ("MULTI_GPU", "MULTI_CPU"):
        return _DATA_PARALLEL_BY_DEVICE.get(device_type, reports_as)
    return reports_as


def first_party(name: str) -> str | None:
    """The first-party plugin an Accelerate name (any spelling: "TE", "DEEPSPEED") stands for."""
    wanted = "".join(ch for ch in str(name).lower() if ch.isalnum())
    return next((n for n in FIRST_PARTY if n == wanted), None)


def fp8_install_hint() -> str:
    """Where to get a low-precision backend when none is installed."""
    return (f" Install one: {install_command('ao')} (torchao; runs on CPU and any CUDA GPU, emulated below sm_89),"
            f" {install_command('te')} (Transformer Engine; sm_89+ GPU) or {install_command('msamp')} (MS-AMP; sm_89+ GPU).")


class DistributedType(str, enum.Enum):
    """How the work is spread over processes; compares equal to its string value."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
