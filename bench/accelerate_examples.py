"""Run Accelerate's own example scripts under lowbit and under Accelerate, and compare what they print.

    python bench/accelerate_examples.py --accelerate-src /path/to/accelerate          # git checkout or bare repo
    python bench/accelerate_examples.py --accelerate-src SRC --processes 2 examples/nlp_example.py
    python bench/accelerate_examples.py --accelerate-src SRC --list
    python bench/accelerate_examples.py --accelerate-src SRC --script-args="--mixed_precision fp8" \\
        examples/by_feature/profiler.py

Nothing of Accelerate's is copied into lowbit: the scripts are read from the Accelerate source you
point at (a checkout, or a bare git repository read with `git show`). Each runs twice, once as it
is and once with `accelerate` replaced by `lowbit` in its imports -- the only change, the drop-in
promise. Hub downloads are replaced at run time, in both runs alike, by offline stand-ins
(`accelerate_examples_offline.py`): an MRPC-shaped synthetic dataset, a word-level tokenizer over
its vocabulary, a small randomly initialised BERT, and an accuracy/F1 metric. The table shows,
per script, whether each run exited 0 and whether the two printed the same metric lines.
Needs: `pip install accelerate transformers datasets evaluate scikit-learn`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (script, its arguments). Scripts needing a GPU-only library, a non-BERT dataset, or another
# launcher (Megatron, TPU, pippy, inference) are left out; `--list` shows the set.
SCRIPTS = {
    "examples/nlp_example.py": ["--cpu"],
    "examples/complete_nlp_example.py": [
        "--cpu",
        "--checkpointing_steps",
        "epoch",
        "--with_tracking",
        "--output_dir",
        "{out}",
        "--project_dir",
        "{out}",
    ],
    "examples/by_feature/checkpointing.py": ["--cpu", "--checkpointing_steps", "epoch", "--output_dir", "{out}"],
    "examples/by_feature/gradient_accumulation.py": ["--cpu", "--gradient_accumulation_steps", "2"],
    "examples/by_feature/multi_process_metrics.py": ["--cpu"],
    "examples/by_feature/tracking.py": ["--cpu", "--with_tracking", "--project_dir", "{out}"],
    "examples/by_feature/memory.py": ["--cpu"],
    "examples/by_feature/early_stopping.py": ["--cpu"],
    "examples/by_feature/local_sgd.py": ["--cpu", "--local_sgd_steps", "2"],
    "examples/by_feature/automatic_gradient_accumulation.py": ["--cpu"],
    "examples/by_feature/ddp_comm_hook.py": ["--cpu", "--ddp_comm_hook", "fp16"],
    "examples/by_feature/profiler.py": ["--cpu"],
    "examples/by_feature/schedule_free.py": ["--cpu"],
    "benchmarks/fp8/torchao/non_distributed.py": [],
    "benchmarks/fp8/torchao/ddp.py": [],
}
METRIC_LINE = re.compile(r"^(epoch \d+:|.*accuracy).*", re.IGNORECASE)


def read_source(src: Path, relative: str) -> str:
    if (src / relative).is_file():
        return (src / relative).read_text()
    return subprocess.run(
        ["git", "--git-dir", str(src), "show", f"HEAD:{relative}"], capture_output=True, text=True, check=True
    ).stdout


def with_lowbit_imports(text: str) -> str:
    """The one change the drop-in promise allows: `accelerate` becomes `lowbit` in imports."""
    text = re.sub(r"^(\s*)from accelerate(\.| )", r"\1from lowbit\2", text, flags=re.MULTILINE)
    return re.sub(r"^(\s*)import accelerate\b", r"\1import lowbit as accelerate", text, flags=re.MULTILINE)


def stage(src: Path, script: str, library: str, workdir: Path) -> Path:
    """Write the script (and its sibling helper modules) into workdir, imports changed for lowbit."""
    folder = Path(script).parent
    for sibling in ("fp8_utils.py",) if "benchmarks" in script else ():
        text = read_source(src, str(folder / sibling))
        (workdir / sibling).write_text(with_lowbit_imports(text) if library == "lowbit" else text)
    text = read_source(src, script)
    target = workdir / Path(script).name
    target.write_text(with_lowbit_imports(text) if library == "lowbit" else text)
    return target


def run_one(
    src: Path, script: str, library: str, processes: int, timeout: float, extra: list[str] = ()
) -> tuple[int, list[str], str, float]:
    workdir = Path(tempfile.mkdtemp(prefix=f"acc-example-{library}-"))
    try:
        target = stage(src, script, library, workdir)
        args = [a.replace("{out}", str(workdir / "out")) for a in [*SCRIPTS.get(script, []), *extra]]
        runner = [str(HERE / "accelerate_examples_offline.py"), str(target), *args]
        if processes == 1:
            cmd = [sys.executable, *runner]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(processes),
                *runner,
            ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_"))}
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            HF_HOME=str(workdir / "hf"),
            WANDB_MODE="disabled",
            PYTHONPATH=str(workdir),
        )
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir, timeout=timeout)
        metrics = [line.strip() for line in proc.stdout.splitlines() if METRIC_LINE.match(line.strip())]
        return proc.returncode, metrics, proc.stderr[-1500:], time.perf_counter() - started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerate-src", type=Path, required=True, help="Accelerate checkout or bare git repository")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--list", action="store_true", help="list the scripts and exit")
    parser.add_argument("--verbose", action="store_true", help="print the metric lines and the stderr of failures")
    parser.add_argument(
        "--script-args", default="", help="more arguments for every script (e.g. \"--mixed_precision fp8\")"
    )
    parser.add_argument("scripts", nargs="*", help=f"default: all {len(SCRIPTS)}")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{s} {' '.join(a)}" for s, a in SCRIPTS.items()))
        return 0
    rows, failures = [], 0
    for script in args.scripts or list(SCRIPTS):
        results = {
            lib: run_one(args.accelerate_src, script, lib, args.processes, args.timeout, args.script_args.split())
            for lib in ("accelerate", "lowbit")
        }
        (acc_rc, acc_metrics, _, acc_s), (low_rc, low_metrics, _, low_s) = results["accelerate"], results["lowbit"]
        same = (
            "same"
            if acc_rc == low_rc == 0 and acc_metrics == low_metrics
            else ("differ" if acc_rc == low_rc == 0 else "-")
        )
        failures += low_rc != 0 or same == "differ"
        rows.append((script, acc_rc, low_rc, same, low_s / max(acc_s, 1e-9)))
        print(
            f"{script:55s} accelerate exit {acc_rc:3d}  lowbit exit {low_rc:3d}  metrics {same:6s}  time ratio "
            f"{low_s / acc_s:.2f}",
            flush=True,
        )
        if args.verbose or low_rc != 0 or same == "differ":
            for lib, (_, metrics, err, _) in results.items():
                print(f"    {lib}: {metrics[-3:]}")
                if results[lib][0] != 0:
                    print("      " + err.replace("\n", "\n      "))
    ran = sum(1 for r in rows if r[2] == 0)
    print(
        f"\n{ran} of {len(rows)} scripts ran under lowbit; {sum(1 for r in rows if r[3] == 'same')} ended on "
        "Accelerate's "
        f"exact metrics; {sum(1 for r in rows if r[1] == 0)} ran under Accelerate ({args.processes} process(es))."
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
