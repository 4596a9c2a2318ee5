"""Start-up cost of the `lowbit` command, and what it imports.

    python bench/startup.py

`lowbit --help` must not import torch; neither command may import a backend library
(transformer_engine, msamp, deepspeed, torchao).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from common import print_table

HEAVY = ("torch", "transformer_engine", "msamp", "deepspeed", "torchao")


def run(argv: list[str], repeats: int = 5) -> tuple[float, str]:
    times, imported = [], ""
    for _ in range(repeats):
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "lowbit.conformance.import_probe", "cli", "--heavy", *HEAVY, "--", *argv],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        times.append(time.perf_counter() - start)
        imported = ",".join(json.loads(out.strip().splitlines()[-1])["imported"]) or "none"
    return statistics.median(times), imported


def bare_python(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    python_only = bare_python()
    rows = [("python -c pass", python_only, "none", 1.0)]
    for label, argv in (("lowbit --help", ["--help"]), ("lowbit plugins", ["plugins"])):
        seconds, imported = run(argv)
        rows.append((label, seconds, imported, seconds / python_only))
    print_table(
        "start-up wall time (median of 5) and heavy modules imported",
        ("command", "seconds", "imports", "x python"),
        rows,
    )
    print("\n--help imports no torch:", "yes" if "torch" not in rows[1][2] else "NO")
    print("no backend library imported:", "yes" if not set(rows[2][2].split(",")) & set(HEAVY[1:]) else "NO")


if __name__ == "__main__":
    main()
