"""The first-party plugin distributions: where each lives, how to install it, which fp8_config
keys it alone defines. The core uses this to give install hints for plugins that are absent."""
from __future__ import annotations

# backend name -> (distribution, folder in a lowbit checkout)
FIRST_PARTY = {
    "msamp": ("lowbit-msamp", "plugins/fp8_msamp"),
    "te": ("lowbit-te", "plugins/fp8_te"),
    "ao": ("lowbit-ao", "plugins/fp8_ao"),
    "deepspeed": ("lowbit-deepspeed", "plugins/dist_deepspeed"),
}

# fp8_config keys that only a first-party backend's recipe defines (the keys Accelerate documents
# are always accepted). tests/test_config.py keeps this in step with the plugins' recipe classes.
PLUGIN_ONLY_FP8_KEYS = {
    "recipe": ("ao",),
    "pad_inner_dim": ("ao",),
    "enable_fsdp_float8_all_gather": ("ao",),
    "force_recompute_fp8_weight_in_bwd": ("ao",),
    "emulate": ("ao",),
    "emulation": ("ao",),
    "optimizer_states": ("ao",),
    "keep_first_last_high_precision": ("ao", "te"),
    "scaling": ("te",),
    "pad_tokens": ("te",),
}


def install_command(backend: str) -> str:
    """How to install a first-party plugin, from PyPI and from a lowbit checkout."""
    distribution, folder = FIRST_PARTY[backend]
    return f"`pip install {distribution}` (from a lowbit checkout: `pip install -e {folder}`)"
