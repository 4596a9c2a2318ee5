"""bench/gpu_llama.py cannot give a figure here (no GPU), but it must run: a smoke run on the CPU,
tiny model, every row that can run here. Checks the script and its table, measures nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_bench_part_runs_its_rows_in_pairs_each_printed_when_done():
    """``bench/gpu_check.py bench --dry-run``: the benchmark part of the GPU check on the CPU, tiny:
    every row that can run here, each lowbit row followed by its hand-written twin, every row's line
    printed (with the pair's ratio) as it ends, not after the last."""
    pytest.importorskip("transformers")
    pytest.importorskip("lowbit_ao")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "bench", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split("  ")[0].strip() for line in proc.stdout.splitlines()]
    pairs = ["bf16", "raw bf16", "fp8 ao tensorwise", "raw torchao tensorwise", "fp8 ao rowwise", "raw torchao rowwise"]
    found = [line for line in lines if line in pairs]
    assert found == pairs, proc.stdout
    for twin in ("raw bf16", "raw torchao tensorwise", "raw torchao rowwise"):  # the pair's ratio on the twin's line
        line = next(line for line in proc.stdout.splitlines() if line.startswith(twin + " "))
        assert re.search(r" \d+\.\d{3}x", line), line  # "vs raw" has three decimals
    assert "fp8 ao tensorwise continue" in proc.stdout
    assert "failed" not in proc.stderr, proc.stderr[-3000:]
    # then the LoRA benchmark's table: a line per setup, with its ratio to bf16 LoRA
    for setup in ("bf16 LoRA", "fp8 LoRA", "fp8 full"):
        assert re.search(rf"^{setup} +[\d.]+ +[\d.]+x +\d+ ", proc.stdout, re.M), proc.stdout[-2000:]


def test_the_gpu_benchmark_stops_cleanly_when_its_budget_would_not_hold_another_row():
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_llama.py"),
            "--device",
            "cpu",
            "--tiny",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--no-compile",
            "--budget",
            "75",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\nbf16 " in proc.stdout and "budget of 75 s spent: not run: " in proc.stdout, proc.stdout


def test_the_gpu_check_tests_part_runs_each_file_alone_and_names_each_outcome():
    """``bench/gpu_check.py tests --dry-run``: every file holding `gpu` tests, one pytest each, a line
    per test with its outcome (here: skipped, saying what is missing), the counts last."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "tests", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tests/plugins/ao/test_ao_gpu.py (" in proc.stdout
    assert "test_ao_gpu::test_real_fp8_gemms_train_close_to_bf16[tensorwise]" in proc.stdout
    assert "needs a CUDA GPU" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].endswith("skipped")


def test_a_test_file_past_its_limit_is_killed_with_every_process_it_started(tmp_path):
    """A stalled file (a `lowbit launch` grandchild waiting on a GPU) must not outlive its limit:
    the whole process group goes, grandchildren included."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    pid_file = tmp_path / "grandchild.pid"
    duration = "301.2345"  # names this grandchild: a busy machine may give its pid to another process after
    assert gpu_check.run_group(["bash", "-c", f"sleep {duration} & echo $! > {pid_file}; wait"], timeout=5) is None
    proc = Path(f"/proc/{pid_file.read_text().strip()}")
    try:
        ours = duration in (proc / "cmdline").read_text() and "zombie" not in (proc / "status").read_text()
    except OSError:  # gone
        ours = False
    assert not ours, "the grandchild outlived its group's kill"


def test_the_formats_benchmark_runs_every_format_and_prints_the_gap_to_bf16(tmp_path):
    """``bench/formats.py`` (the README's formats table) at 3 steps: every format trains, the
    table has a row per format with its gap to bf16, and the JSON and plot are written."""
    pytest.importorskip("transformers")
    pytest.importorskip("lowbit_ao")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "formats.py"),
            "--steps",
            "3",
            "--hidden",
            "64",
            "--seq",
            "32",
            "--batch",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )
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
    env = {
        "PATH": f"{ROOT / 'tests' / 'shims'}:/usr/bin:/bin",
        "ARGV_LOG": str(log),
        **({"GPU_PLATFORM": platform} if platform else {}),
        **({"GPU_PYTHON_VERSION": python} if python else {}),
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "wheels", str(tmp_path / "wheels")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    download = next(line.split() for line in log.read_text().splitlines() if "download" in line)
    assert "torchao==0.18.0" in download
    for flag, value in (
        ("--platform", platform or "manylinux_2_28_x86_64"),
        ("--python-version", python or "3.10"),
        ("--implementation", "cp"),
    ):
        assert download[download.index(flag) + 1] == value, download
    assert "--only-binary=:all:" in download and "--no-deps" in download
