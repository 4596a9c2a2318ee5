"""The compiler torch.compile needs: found, or a clear error before it is needed.

torch.compile's default backend (inductor) builds code with the system's compilers at the first
forward: on a CPU it writes C++ and builds it with a C++ compiler; on a GPU, Triton builds each
kernel's launcher with a C compiler (and says "Failed to find C compiler" from deep inside the
first compiled call without one, a GPU image without gcc being common). lowbit says so at
``prepare()`` and in ``lowbit env`` instead. Nothing else lowbit runs compiles anything
(DeepSpeed's shared-memory kernels are kept off, see lowbit-deepspeed).
"""

from __future__ import annotations

import os
import shutil

# Per device type: the variable naming the compiler, the names tried without it (torch's C++
# builder for the CPU; Triton's runtime/build.py for CUDA, gcc then clang), and what it builds.
TOOLCHAINS = {
    "cpu": ("CXX", ("c++", "g++", "clang++"), "C++", "builds C++ for the CPU"),
    "cuda": ("CC", ("gcc", "clang"), "C", "has Triton build each GPU kernel's launcher with a C compiler"),
}
# torch.compile backends that generate code built by those compilers
COMPILING_BACKENDS = frozenset({"inductor"})
INSTALL = {
    "C++": "`apt install g++`, `dnf install gcc-c++`, or `conda install gxx`",
    "C": "`apt install gcc`, `dnf install gcc`, or `conda install gcc`",
}


def find_compiler(device_type: str = "cpu") -> str | None:
    """Path of the compiler inductor needs on ``device_type`` ($CXX / $CC, else the first name found
    on PATH); None if none."""
    variable, names, _, _ = TOOLCHAINS[device_type]
    for name in [os.environ[variable]] if os.environ.get(variable) else list(names):
        path = shutil.which(name)
        if path:
            return path
    return None


def find_cxx_compiler() -> str | None:
    """The C++ compiler torch.compile needs on a CPU (``lowbit env`` shows it)."""
    return find_compiler("cpu")


def missing_compiler_advice(backend: str, device_type: str = "cpu") -> str:
    variable, names, language, builds = TOOLCHAINS[device_type]
    looked_for = f"${variable}={os.environ[variable]}" if os.environ.get(variable) else ", ".join(names)
    return (
        f"torch.compile with dynamo_backend={backend!r} {builds} at the first forward, and no {language} "
        f"compiler was found (looked for {looked_for} on PATH). Install one ({INSTALL[language]}) or set "
        f"{variable} to its path; or train without compiling (dynamo_backend='no'), or with "
        "dynamo_backend='aot_eager', which compiles nothing."
    )


def check_compiler_for(backend: str | None, device_type: str) -> str | None:
    """The advice when ``backend`` on ``device_type`` needs a compiler that is missing, else None."""
    if backend is None or backend.lower() not in COMPILING_BACKENDS or device_type not in TOOLCHAINS:
        return None
    return None if find_compiler(device_type) else missing_compiler_advice(backend, device_type)
