"""How many GPUs this machine offers, counted without touching CUDA in this process.

Asking torch here (``torch.cuda.is_available()``, or ``device_count()`` where NVML is missing)
registers CUDA's fork handler: every process forked afterwards is a "bad fork" and dies the moment
it uses the GPU (pytorch#85951). The launchers that fork (``notebook_launcher``) therefore count
in a short child process: ``python -m lowbit.runtime.gpu_count`` prints the count.
"""

from __future__ import annotations

import subprocess
import sys


def count_gpus_without_cuda_here() -> int:
    """The GPUs torch would see in a new process (CUDA_VISIBLE_DEVICES honoured); 0 with a torch
    built without CUDA or ROCm, asked without a child. About a second, the time to import torch."""
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return 0
    if torch.cuda.is_initialized():  # in use here already: the fork is spoilt either way, asking costs nothing
        return torch.cuda.device_count()
    counted = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, timeout=300)
    if counted.returncode != 0:
        raise RuntimeError(f"counting this machine's GPUs in a child process failed:\n{counted.stderr[-2000:]}")
    return int(counted.stdout.split()[-1])


if __name__ == "__main__":
    import torch

    print(torch.cuda.device_count())
