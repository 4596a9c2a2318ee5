"""The conformance kit for distributed strategies: ``run_strategy_conformance("mystrategy")``.

It runs :mod:`lowbit.conformance.strategy_worker` the way users run a script, under ``lowbit launch
--cpu --num_processes 2 --distributed_type NAME`` (over gloo), and once alone as the reference,
and checks what every data-parallel strategy owes its users:

- the strategy asked for is the one that ran;
- every rank ends with the same model;
- the model and the losses equal one process training on the same global batch;
- ``save_state`` mid-way and ``load_state`` into a fresh model continue exactly as the
  uninterrupted run did.

A failure names the check and shows the numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lowbit.conformance.setup import fail

WORKER = "lowbit.conformance.strategy_worker"
# fp32 sums in another order (gradient all-reduce) stay this close to one process's.
RTOL, ATOL = 1e-4, 1e-6


def _run(command: list[str], env: dict[str, str], what: str, strategy: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1500)
    if proc.returncode != 0:
        fail(strategy, what, f"exit status {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL) for x, y in zip(a, b))


def _max_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> tuple[str, float]:
    worst = max(((k, max((abs(x - y) for x, y in zip(a[k], b[k])), default=0.0)) for k in a), key=lambda kv: kv[1])
    return worst


def run_strategy_conformance(
    strategy: str,
    tmp_path: str | os.PathLike,
    num_processes: int = 2,
    launch_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Train under ``strategy`` in ``num_processes`` processes and against one process; raise
    ``ConformanceFailure`` naming the broken promise. Returns the per-rank results."""
    out, reference_out = Path(tmp_path) / "strategy", Path(tmp_path) / "reference"
    out.mkdir(parents=True, exist_ok=True)
    reference_out.mkdir(parents=True, exist_ok=True)
    base_env = {k: v for k, v in (env or os.environ).items() if not k.startswith(("LOWBIT_", "ACCELERATE_"))}
    base_env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    _run(
        [sys.executable, "-m", WORKER, str(reference_out), "--reference"],
        {**base_env, "LOWBIT_USE_CPU": "1"},
        "the one-process reference run",
        strategy,
    )
    _run(
        [
            sys.executable,
            "-m",
            "lowbit.cli.main",
            "launch",
            "--cpu",
            "--num_processes",
            str(num_processes),
            "--distributed_type",
            strategy,
            *launch_args,
            "-m",
            WORKER,
            str(out),
        ],
        base_env,
        "lowbit launch",
        strategy,
    )
    reference = json.loads((reference_out / "reference.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(num_processes)]

    from lowbit.run.plugin_manager import registry_for_names

    found = registry_for_names().strategy_for(strategy)
    expected = found.name if found is not None else strategy
    if {r["strategy"] for r in ranks} != {expected} or any(r["world_size"] != num_processes for r in ranks):
        fail(
            strategy,
            "strategy choice",
            f"ran {[r['strategy'] for r in ranks]} on {ranks[0]['world_size']} processes, "
            f"not {expected!r} on {num_processes}",
        )
    for r, rank in enumerate(ranks[1:], start=1):
        key, diff = _max_difference(rank["state"], ranks[0]["state"])
        if diff > ATOL:
            fail(
                strategy,
                "wrap_for_distribution",
                f"rank {r} ends with another model than rank 0 ({key} differs by {diff:.3g})",
            )
    if not _close(ranks[0]["losses"], reference["losses"]):
        fail(
            strategy,
            "wrap_for_distribution / backward",
            f"losses {ranks[0]['losses']} differ from one process on the same global batch: {reference['losses']}",
        )
    key, diff = _max_difference(ranks[0]["state"], reference["state"])
    if diff > max(ATOL, RTOL * max(abs(v) for v in reference["state"][key])):
        fail(strategy, "wrap_for_distribution", f"the trained model differs from one process's ({key} by {diff:.3g})")
    for r, rank in enumerate(ranks):
        expected = rank["losses"][len(rank["losses"]) - len(rank["resumed_losses"]) :]
        if not _close(rank["resumed_losses"], expected):
            fail(
                strategy,
                "save_checkpoint / load_checkpoint",
                f"rank {r}: after load_state the losses are "
                f"{rank['resumed_losses']}, the uninterrupted run's {expected}",
            )
    return {"ranks": ranks, "reference": reference}
