"""Whether torchao's native MXFP8 kernels can run here, or its emulated ones must.

torchao 0.18's MXFP8 training GEMM (``prototype/moe_training/mxfp8_linear.py``
``_to_mxfp8_then_scaled_mm`` with ``KernelPreference.AUTO``) casts along dim 0 with a triton
kernel and along dim 1 with ``torchao::mxfp8_quantize``, a CUDA op whose kernel lives in the
``_C_mxfp8`` extension built for sm_100a (``prototype/mx_formats/kernels.py``: the op is defined
whenever the GPU reports sm_100+ and CUDA 12.8+, whether or not the extension loaded;
``torchao/__init__.py`` only warns when a ``_C*.so`` fails to load). So "sm_100+" is not enough:

* :func:`mxfp8_kernels_problem` reads what it can without importing torchao (for the ranking and
  ``lowbit env``): a Blackwell of another family than sm_10x (sm_120: the sm_100a build is not
  known to run there), no triton, no ``_C_mxfp8`` extension file (torchao's py3-none-any wheel);
* :func:`mxfp8_op_problem` asks torch, once torchao is imported at ``prepare()``, whether the op
  has a CUDA kernel, i.e. whether the extension really loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lowbit.kernel.plugin_api import HardwareInfo

MXFP8_OP = "torchao::mxfp8_quantize"
# The compute capability major torchao's _C_mxfp8 is built for (sm_100a: B200, GB200, B300).
BUILT_FOR_MAJOR = 10


def _torchao_folder() -> Path | None:
    spec = importlib.util.find_spec("torchao")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def mxfp8_kernels_problem(hardware: HardwareInfo) -> str:
    """Why torchao's native MXFP8 kernels cannot run on ``hardware`` with what is installed, or ''.
    '' too below sm_100, where the recipe's own hardware rule already makes MXFP8 emulated."""
    capability = hardware.compute_capability
    if capability is None or capability < (10, 0):
        return ""
    if capability[0] != BUILT_FOR_MAJOR:
        return (
            f"torchao's MXFP8 cast kernel ({MXFP8_OP}, extension _C_mxfp8) is built for sm_100a; on "
            f"{hardware.describe()} it is not known to run"
        )
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (torchao's MXFP8 dim-0 cast is a triton kernel): `pip install triton`"
    folder = _torchao_folder()
    if folder is not None and not any(folder.glob("_C_mxfp8*.so")):
        return (
            f"this torchao ({folder}) has no _C_mxfp8 extension, which holds {MXFP8_OP}'s CUDA kernel: install "
            "torchao's CUDA wheel for x86-64 (`pip install torchao`), not its py3-none-any wheel"
        )
    return ""


def mxfp8_op_problem() -> str:
    """After ``import torchao``: why ``torchao::mxfp8_quantize`` has no CUDA kernel, or ''."""
    import torch

    try:
        loaded = torch._C._dispatch_has_kernel_for_dispatch_key(MXFP8_OP, "CUDA")
    except RuntimeError:  # the op is not even defined (no CUDA sm_100+ seen by torchao)
        loaded = False
    if loaded:
        return ""
    return (
        f"{MXFP8_OP} has no CUDA kernel in this process: torchao's _C_mxfp8 extension did not load (torchao "
        "logs why at import; often a torch it was not built for)"
    )
