"""The GPU machine's verdict in two calls, each inside a short GPU slot (at most 10 minutes a command).

    python bench/gpu_check.py tests [--budget 540]   # (a) every `gpu` test file, each under its own limit
    python bench/gpu_check.py bench [--budget 540]   # (b) the Llama benchmark, lowbit rows beside their raw twins
    python bench/gpu_check.py tests --dry-run         # both on a CPU, tiny (CI runs these: the script cannot rot)
    python bench/gpu_check.py bench --dry-run

``bench/gpu_check.sh tests`` and ``... bench`` install the carried wheels and call these. Each part
prints as it goes, so a call cut short still returns what was done:

(a) ``pytest -m gpu`` on one test file at a time (a file whose library or GPU is absent skips with the
    reason), each in its own process group under ``--file-timeout`` seconds and the total ``--budget``;
    a file past its limit is killed with everything it started (``lowbit launch`` grandchildren
    included) and named. A line per test as its file ends, then the counts. Exit 1 when a test failed.
(b) ``bench/gpu_llama.py`` with its rows in pairs (each lowbit row next to the hand-written row doing
    the same work, so every pair is a ratio on its own), every row printed when it ends, stopping
    cleanly when the budget would not hold another row; then ``bench/lora.py`` (FP8 LoRA, bf16 LoRA
    and an FP8 full fine-tune on Llama-3-8B-shaped layers) in the last ``LORA_BUDGET_S`` seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A lent GPU comes for minutes: one command may run 10, so each part stops itself before 9.
BUDGET_S = 540
FILE_TIMEOUT_S = 180
# Llama-3-8B's layers (4 of them, seq 8192, batch 1, compiled): the hot path's configuration (issue 45).
BENCH_SHAPE = "llama3-8b-4l"
# Of the bench part's budget, what the LoRA benchmark (bench/lora.py, after the Llama rows) is given.
LORA_BUDGET_S = 150


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu` tests (collecting only those: the others may need packages
    a GPU image lacks, which is no verdict on the GPU)."""
    marks = ("needs_fp8_gpu_with(", "pytest.mark.gpu")
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if any(mark in p.read_text() for mark in marks)
    )


def gpu_description() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU (torch {torch.__version__})"
    major, minor = torch.cuda.get_device_capability()
    return (
        f"{torch.cuda.get_device_name()} (sm_{major}{minor}) x{torch.cuda.device_count()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}"
    )


def test_outcomes(report: Path) -> list[tuple[str, str, str]]:
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                text = node.get("message") or node.text or ""
                detail = text.strip().splitlines()[0] if text.strip() else ""
                break
        rows.append((name, outcome, detail))
    return rows


def run_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess | None:
    """``cmd`` in a process group of its own; past ``timeout`` the whole group is killed (None)."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_tests(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.budget
    counts = {"passed": 0, "skipped": 0, "FAILED": 0, "ERROR": 0}
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.dry_run else {})}
    files = gpu_test_files()
    print(
        f"{len(files)} files hold gpu tests; each may take {args.file_timeout:.0f} s, all {args.budget:.0f} s",
        flush=True,
    )
    for index, path in enumerate(files):
        left = deadline - time.monotonic()
        if left < 10:
            print(f"budget spent: not run: {', '.join(files[index:])}", flush=True)
            counts["ERROR"] += 1
            break
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "gpu.xml"
            start = time.monotonic()
            proc = run_group(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-m",
                    "gpu",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={report}",
                    path,
                ],
                min(args.file_timeout, left),
                env=env,
            )
            took = time.monotonic() - start
            if proc is None:
                print(f"{path}: stopped after {took:.0f} s, its processes killed", flush=True)
                counts["ERROR"] += 1
                continue
            if not report.exists():
                print(
                    f"{path}: pytest did not run (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}",
                    flush=True,
                )
                counts["ERROR"] += 1
                continue
            rows = test_outcomes(report)
        print(f"{path} ({took:.0f} s)", flush=True)
        for name, outcome, detail in rows:
            counts[outcome] += 1
            print(f"  {name:<70} {outcome:<8} {detail[:110]}", flush=True)
    print(", ".join(f"{n} {o}" for o, n in counts.items() if n) or "no gpu test ran", flush=True)
    return 1 if counts["FAILED"] or counts["ERROR"] else 0


def run_bench(args: argparse.Namespace) -> int:
    shape = (
        ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--no-compile"]
        if args.dry_run
        else ["--shape", BENCH_SHAPE]
    )
    llama_budget = args.budget - LORA_BUDGET_S
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_llama.py"), *shape, "--budget", str(llama_budget)]
    started = time.monotonic()
    status = subprocess.run(cmd, cwd=ROOT).returncode
    # FP8 LoRA beside bf16 LoRA and an FP8 full fine-tune (bench/lora.py), in what the budget has left
    left = max(args.budget - (time.monotonic() - started), 30.0)
    lora = ["--dry-run"] if args.dry_run else ["--shape", "llama3-8b", "--device", "cuda", "--steps", "5"]
    cmd = [sys.executable, str(ROOT / "bench" / "lora.py"), *lora, "--budget", str(left * 0.6)]
    try:
        lora_status = subprocess.run(cmd, cwd=ROOT, timeout=left).returncode
    except subprocess.TimeoutExpired:
        print(f"bench/lora.py: stopped at the budget's end ({left:.0f} s)", flush=True)
        lora_status = 0
    return status or lora_status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("tests", "bench"))
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S, help=f"seconds for the whole part (default {BUDGET_S})"
    )
    parser.add_argument(
        "--file-timeout",
        type=float,
        default=FILE_TIMEOUT_S,
        help=f"seconds for one test file (default {FILE_TIMEOUT_S})",
    )
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny: checks this script, measures nothing")
    args = parser.parse_args()
    print(f"GPU check ({args.part}): {'dry run on the CPU' if args.dry_run else gpu_description()}", flush=True)
    return run_tests(args) if args.part == "tests" else run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
