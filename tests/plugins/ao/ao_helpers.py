"""What test_ao.py (CPU) and test_ao_gpu.py (CUDA) share: launching ddp_worker.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from helpers import run_launch

DDP_WORKER = Path(__file__).with_name("ddp_worker.py")
REPO = Path(__file__).parents[3]


def launch_ddp_worker(*launch_flags: str) -> dict:
    """``lowbit launch <launch_flags> --mixed_precision fp8 ddp_worker.py``; the main rank's JSON line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    proc = run_launch(
        [sys.executable, "-m", "lowbit.cli.main", "launch", *launch_flags, "--mixed_precision", "fp8", str(DDP_WORKER)],
        env={**env, "OMP_NUM_THREADS": "1"},
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
