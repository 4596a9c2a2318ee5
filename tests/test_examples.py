"""Every example runs as the README says, on CPU: the seed loop under each config, and the main job."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_launch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
pytestmark = pytest.mark.multiprocess


def run(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return run_launch([sys.executable, *args], env=env, cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_seed_loop_runs_under_each_config(config):
    if "deepspeed" in config.stem:
        pytest.importorskip("lowbit_deepspeed")
    proc = run("-m", "lowbit.cli.main", "launch", "--config_file", str(config), "examples/fp8_train.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"epoch \d: loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout
    assert "fp8_backend=ao" in proc.stdout


def test_main_job_runs_across_two_processes(tmp_path):
    proc = run("-m", "lowbit.cli.main", "launch", "--cpu", "--num_processes", "2", "examples/char_gpt.py",
               "--precisions", "fp8", "--steps", "15", "--plot", str(tmp_path / "loss.png"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"^fp8\s+ao\s+[\d.]+", proc.stdout, re.M), proc.stdout
    assert (tmp_path / "loss.png").exists()


def test_main_job_compares_three_precisions(tmp_path):
    proc = run("examples/char_gpt.py", "--steps", "12", "--sentences", "300", "--plot", str(tmp_path / "loss.png"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for precision in ("fp32", "bf16", "fp8"):
        assert re.search(rf"^{precision}\s+\w+\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+\d+", proc.stdout, re.M), proc.stdout
    assert f"loss curves written to {tmp_path / 'loss.png'}" in proc.stdout
