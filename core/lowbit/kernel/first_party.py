"""The plugins lowbit publishes itself, by name: which distribution to install when one is asked
for and absent (an installed plugin describes itself; an absent one cannot, so the kernel knows
these four)."""

from __future__ import annotations

from lowbit.kernel.types import normalize_name

# The plugins lowbit publishes -> (distribution, folder in a lowbit checkout)
FIRST_PARTY = {
    "msamp": ("lowbit-msamp", "plugins/fp8_msamp"),
    "te": ("lowbit-te", "plugins/fp8_te"),
    "ao": ("lowbit-ao", "plugins/fp8_ao"),
    "deepspeed": ("lowbit-deepspeed", "plugins/dist_deepspeed"),
}
# The low-precision backends among them (Accelerate's ``fp8_backend`` values).
FIRST_PARTY_BACKENDS = ("msamp", "te", "ao")
# Config sections read by a first-party strategy -> that plugin (named when it is absent).
FIRST_PARTY_SECTIONS = {"deepspeed_config": "deepspeed"}


def install_command(backend: str) -> str:
    """How to install a first-party plugin, from PyPI and from a lowbit checkout."""
    distribution, folder = FIRST_PARTY[backend]
    return f"`pip install {distribution}` (from a lowbit checkout: `pip install -e {folder}`)"


def first_party(name: str) -> str | None:
    """The first-party plugin an Accelerate name (any spelling: "TE", "DEEPSPEED") stands for."""
    wanted = normalize_name(name)
    return next((n for n in FIRST_PARTY if n == wanted), None)


def fp8_install_hint() -> str:
    """Where to get a low-precision backend when none is installed."""
    return (
        f" Install one: {install_command('ao')} (torchao; runs on CPU and any CUDA GPU, emulated below sm_89),"
        f" {install_command('te')} (Transformer Engine; sm_89+ GPU) or {install_command('msamp')} (MS-AMP; sm_89+ GPU)."
    )
