"""The GPU machine's verdict in one table: every `gpu` test, then the Llama benchmark.

    python bench/gpu_check.py            # (bench/gpu_check.sh run calls this)

Runs ``pytest -m gpu`` over the plugin tests (a test whose library or GPU is absent is skipped
with the reason), reads the outcome of each from pytest's JUnit XML, and prints one table: test,
outcome, and why it was skipped or how it failed. Then ``bench/gpu_llama.py``'s table, when a
CUDA GPU is here. Exit status: 1 when a test failed.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# A lent GPU comes for minutes: each part stops at its limit and the rest still runs.
TESTS_TIMEOUT_S = 240
ROW_TIMEOUT_S = 120


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu` tests (collecting only those: the others may need packages
    a GPU image lacks, which is no verdict on the GPU)."""
    marks = ("needs_fp8_gpu_with(", "pytest.mark.gpu")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if any(mark in p.read_text() for mark in marks))


def gpu_description() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU (torch {torch.__version__})"
    major, minor = torch.cuda.get_device_capability()
    return (f"{torch.cuda.get_device_name()} (sm_{major}{minor}) x{torch.cuda.device_count()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}")


def test_outcomes(report: Path) -> list[tuple[str, str, str]]:
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                detail = (node.get("message") or node.text or "").strip().splitlines()[0] if (node.get("message") or node.text) else ""
                break
        rows.append((name, outcome, detail))
    return rows


def main() -> int:
    print(f"GPU check: {gpu_description()}")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "gpu.xml"
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                   f"--junitxml={report}", *gpu_test_files()], cwd=ROOT, capture_output=True, text=True,
                                  timeout=TESTS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"the gpu tests ran past {TESTS_TIMEOUT_S} s; stopped (the benchmark still runs)")
            proc = None
        if not report.exists():
            if proc is not None:
                print(f"pytest did not run (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
            rows = []
        else:
            rows = test_outcomes(report)
    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"\n{'gpu test':<{width}}  {'outcome':<8}  why")
    for name, outcome, detail in rows:
        print(f"{name:<{width}}  {outcome:<8}  {detail[:110]}")
    counts = {o: sum(1 for r in rows if r[1] == o) for o in ("passed", "skipped", "FAILED", "ERROR")}
    print("\n" + ", ".join(f"{n} {o}" for o, n in counts.items() if n))
    import torch

    if torch.cuda.is_available():
        print()
        # the hot path's configuration (issue 45): Llama-3-8B's layers, 4 of them, seq 8192, batch 1, compiled
        subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_llama.py"), "--shape", "llama3-8b-4l",
                        "--row-timeout", str(ROW_TIMEOUT_S)], cwd=ROOT)
    else:
        print("benchmark: skipped (bench/gpu_llama.py needs a CUDA GPU)")
    return 1 if counts["FAILED"] or counts["ERROR"] or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
