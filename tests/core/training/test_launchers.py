"""The launchers that fork (notebook_launcher) must leave the children able to use CUDA: counting
GPUs with torch.cuda in the parent spoils every fork. Runs where torch is a CUDA build (CI's torch
2.11 lane takes the registry's CUDA build, which runs on a CPU); a CPU-only torch has no such rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.multiprocess
@pytest.mark.skipif(
    torch.version.cuda is None, reason="a CPU-only torch has no CUDA fork rule; CI's CUDA-build lane runs this"
)
def test_notebook_launcher_forks_children_that_can_still_use_cuda(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    with open(SCRIPTS / "fork_check_cell.py") as cell:
        proc = subprocess.run(
            [sys.executable, "-", str(tmp_path)],
            stdin=cell,
            capture_output=True,
            text=True,
            env={**env, "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    children = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert children == [{"bad_fork": False}] * 2, "the parent touched CUDA before forking"


def test_a_cpu_only_torch_counts_no_gpu_without_a_child(monkeypatch):
    from lowbit.runtime import gpu_count

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child process was started"))
    assert gpu_count.count_gpus_without_cuda_here() == 0


def test_a_child_process_counts_the_gpus_as_torch_sees_them():
    """`python -m lowbit.runtime.gpu_count` prints the count torch gives in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit.runtime.gpu_count"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) == torch.cuda.device_count()
