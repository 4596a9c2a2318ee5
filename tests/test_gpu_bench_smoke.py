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
    for row in ("bf16", "raw bf16", "fp8 ao tensorwise", "fp8 ao rowwise", "raw torchao tensorwise", "raw torchao rowwise"):
        assert f"\n{row} " in table, table
    assert "failed" not in proc.stderr, proc.stderr[-3000:]


def test_the_formats_benchmark_runs_every_format_and_prints_the_gap_to_bf16(tmp_path):
    """``bench/formats.py`` (the README's formats table) at 3 steps: every format trains, the
    table has a row per format with its gap to bf16, and the JSON and plot are written."""
    pytest.importorskip("transformers")
    pytest.importorskip("lowbit_ao")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "formats.py"), "--steps", "3", "--hidden", "64",
                           "--seq", "32", "--batch", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("  ")[0].strip(): line for line in proc.stdout.splitlines()[-6:]}
    for label in ("fp8 tensorwise", "fp8 rowwise", "mxfp8", "nvfp4"):
        assert label in rows and rows[label].rstrip().endswith("emulated"), proc.stdout[-2000:]
        assert "+" in rows[label] or "-0." in rows[label]  # a signed gap to bf16
    assert (tmp_path / "formats.json").exists()


@pytest.mark.parametrize("platform, python", [(None, None), ("manylinux_2_28_aarch64", "3.12")])
def test_the_gpu_wheels_step_downloads_for_the_gpu_machine_not_this_one(tmp_path, platform, python):
    """``bench/gpu_check.sh wheels`` on a laptop (macOS, ARM) must still carry the x86-64 CUDA
    machine's torchao wheel (kernels included), not the laptop's. pip is recorded, not run."""
    log = tmp_path / "argv.txt"
    env = {"PATH": f"{ROOT / 'tests' / 'shims'}:/usr/bin:/bin", "ARGV_LOG": str(log),
           **({"GPU_PLATFORM": platform} if platform else {}), **({"GPU_PYTHON_VERSION": python} if python else {})}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "wheels", str(tmp_path / "wheels")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    download = next(line.split() for line in log.read_text().splitlines() if "download" in line)
    assert "torchao==0.18.0" in download
    for flag, value in (("--platform", platform or "manylinux_2_28_x86_64"), ("--python-version", python or "3.10"),
                        ("--implementation", "cp")):
        assert download[download.index(flag) + 1] == value, download
    assert "--only-binary=:all:" in download and "--no-deps" in download
