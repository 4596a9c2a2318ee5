"""Back-to-back 2-process launches of the seed example: how many exit 0, and why the others did not.

    python bench/launch_reliability.py                  # 60 launches of examples/fp8_train.py (DDP, fp8)
    python bench/launch_reliability.py -n 20 --config examples/configs/fsdp.yaml

Each launch is `lowbit launch --config_file CONFIG examples/fp8_train.py`, run to completion one
after another. A failure prints its exit status and the tail of its stderr. Exit status: 0 when
every launch exited 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=60, help="number of launches")
    parser.add_argument("--config", default=str(ROOT / "examples/configs/ddp.yaml"))
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    command = [
        sys.executable,
        "-m",
        "lowbit.cli.main",
        "launch",
        "--config_file",
        args.config,
        str(ROOT / "examples/fp8_train.py"),
    ]
    failures = []
    started = time.perf_counter()
    for i in range(1, args.n + 1):
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        print(f"launch {i:3d}/{args.n}: {status}", flush=True)
        if proc.returncode != 0:
            failures.append(i)
            print("\n".join("    " + line for line in proc.stderr.splitlines()[-15:]), flush=True)
    elapsed = time.perf_counter() - started
    print(
        f"\n{args.n - len(failures)} of {args.n} launches exited 0 ({elapsed / args.n:.1f} s per launch)"
        + (f"; failed: {failures}" if failures else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
