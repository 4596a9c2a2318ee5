"""bench/gpu_llama.py cannot give a figure here (no GPU), but it must run: a smoke run on the CPU,
tiny model, every row that can run here. Checks the script and its table, measures nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_benchmark_runs_every_row_it_can_and_prints_its_table():
    pytest.importorskip("transformers")
    pytest.importorskip("lowbit_ao")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_llama.py"), "--device", "cpu", "--tiny", "--steps", "1",
                           "--warmup", "1", "--no-compile", "--seq", "32", "--batch", "2"],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    for row in ("bf16", "fp8 ao tensorwise", "fp8 ao rowwise", "raw torchao tensorwise"):
        assert f"\n{row} " in table, table
    assert "failed" not in proc.stderr, proc.stderr[-3000:]
