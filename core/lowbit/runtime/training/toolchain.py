"""The C++ compiler that torch.compile needs on CPU: found, or a clear error before it is needed.

torch.compile's default backend (inductor) writes C++ for CPU kernels and builds it with the
system compiler at the first forward. Without one, the failure comes from deep inside the first
compiled call; lowbit says so at ``prepare()`` and in ``lowbit env`` instead. Nothing else lowbit
runs on CPU compiles anything (DeepSpeed's shared-memory kernels are kept off, see lowbit-deepspeed).
"""
from __future__ import annotations

import os
import shutil

# the names torch's C++ builder tries when $CXX is not set
COMPILER_NAMES = ("c++", "g++", "clang++")
# torch.compile backends that generate C++ for CPU code
COMPILING_BACKENDS = frozenset({"inductor"})


def find_cxx_compiler() -> str | None:
    """Path of the compiler $CXX names (or the first of COMPILER_NAMES on PATH); None if none."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else list(COMPILER_NAMES)
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def missing_compiler_advice(backend: str) -> str:
    looked_for = f"$CXX={os.environ['CXX']}" if os.environ.get("CXX") else ", ".join(COMPILER_NAMES)
    return (f"torch.compile with dynamo_backend={backend!r} builds C++ for the CPU at the first forward, "
            f"and no C++ compiler was found (looked for {looked_for} on PATH). Install one "
            "(`apt install g++`, `dnf install gcc-c++`, or `conda install gxx`) or set CXX to its path; "
            "or train without compiling (dynamo_backend='no'), or with dynamo_backend='aot_eager', "
            "which compiles nothing.")


def check_compiler_for(backend: str | None, device_type: str) -> str | None:
    """The advice when ``backend`` on ``device_type`` needs a compiler that is missing, else None."""
    if backend is None or backend.lower() not in COMPILING_BACKENDS or device_type != "cpu":
        return None
    return None if find_cxx_compiler() else missing_compiler_advice(backend)
