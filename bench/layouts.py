"""Per N-D layout x activation checkpointing x precision: step time (as a ratio to DDP in bf16,
measured in the same run), tokens/s, and each rank's peak memory.

    python bench/layouts.py [--num_processes 4] [--gpu]

Each row is one ``lowbit launch`` of ``bench/layouts_worker.py`` (a 4-layer Llama, hidden 512,
sequence 256, global batch 8). On a CPU the processes share its cores, so the ratios say what each
layout costs in work and communication there, not what it gains on GPUs; ``--gpu`` launches on the
GPUs instead (tokens/s is then the figure to read).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("layouts_worker.py")
# name -> (ParallelismConfig sizes for N processes, strategy flag); N = --num_processes (4: 2 x 2).
LAYOUTS = {
    "DDP": (lambda n: [f"dp_replicate_size={n}"], ()),
    "FSDP2": (lambda n: [f"dp_shard_size={n}"], ("--use_fsdp",)),
    "HSDP": (lambda n: ["dp_replicate_size=2", f"dp_shard_size={n // 2}"], ("--use_fsdp",)),
    "TP": (lambda n: [f"tp_size={n}"], ()),
    "FSDP2xTP": (lambda n: [f"dp_shard_size={n // 2}", "tp_size=2"], ("--use_fsdp",)),
}


def run(
    sizes: list[str], flags: tuple[str, ...], precision: str, checkpointing: str, processes: int, gpu: bool
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        device = [] if gpu else ["--cpu"]
        extra = [f"ac={checkpointing}"] if checkpointing != "off" else []
        cmd = [
            sys.executable,
            "-m",
            "lowbit.cli.main",
            "launch",
            *device,
            "--num_processes",
            str(processes),
            *flags,
            str(WORKER),
            str(out),
            *sizes,
            f"mp={precision}",
            *extra,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "Error" in line] or proc.stderr.splitlines() or ["?"]
            return {"error": errors[-1].strip()[:120]}
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_processes", type=int, default=4)
    parser.add_argument("--gpu", action="store_true", help="launch on the GPUs (default: CPU processes over gloo)")
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=list(LAYOUTS),
        default=list(LAYOUTS),
        help="the layouts to run (DDP bf16, the base of the ratios, always runs first)",
    )
    args = parser.parse_args()
    print(
        f"{'layout':<10} {'AC':<9} {'precision':<9} {'step ms':>8} {'vs DDP bf16':>11} {'tokens/s':>9}  peak MiB per "
        "rank"
    )
    base = None
    rows = [("DDP", "off", "bf16")] + [
        (name, checkpointing, precision)
        for name in args.layouts
        for checkpointing in (("off", "full", "selective") if "--use_fsdp" in LAYOUTS[name][1] else ("off",))
        for precision in ("bf16", "fp8")
        if (name, checkpointing, precision) != ("DDP", "off", "bf16")
    ]
    for name, checkpointing, precision in rows:
        sizes, flags = LAYOUTS[name]
        result = run(sizes(args.num_processes), flags, precision, checkpointing, args.num_processes, args.gpu)
        if "error" in result:
            print(f"{name:<10} {checkpointing:<9} {precision:<9} failed: {result['error']}", flush=True)
            continue
        base = base or result["step_s"]
        peaks = " ".join(f"{p:.0f}" for p in result["peak_mib"])
        print(
            f"{name:<10} {checkpointing:<9} {precision:<9} {result['step_s'] * 1e3:>8.0f} "
            f"{result['step_s'] / base:>11.2f} {result['tokens_per_s']:>9.0f}  {peaks}",
            flush=True,
        )


if __name__ == "__main__":
    main()
