"""Killed at any step and resumed from its checkpoint (mid-epoch included, with Accelerate's
``skip_first_batches`` pattern), a run ends on weights bit-identical to an uninterrupted one:
the epoch's shuffle order, dropout's RNG, the scheduler and the optimizer all continue exactly."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import TESTS, launch_argv, run_launch

WORKER = TESTS / "distributed" / "resume_worker.py"
pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("variant", ["shuffle", "accumulate", "batch_sampler", "iterable", "fp8", "seedable"])
@pytest.mark.parametrize("world", [1, 2])
def test_kill_and_resume_at_every_step_is_bit_identical(tmp_path, world, variant):
    """Saved right after each step, inside the loop; at an epoch's last step that resumed into the
    next epoch with the finished epoch's shuffle order (epoch 0's again). With gradient
    accumulation, at every optimizer step (a save between micro-steps keeps no gradients, as in
    Accelerate)."""
    if variant == "fp8":
        pytest.importorskip("lowbit_ao")
    steps_total = 3 * 40 // (4 * world)  # 3 epochs of 40 samples, batches of 4 per process
    every = 2 if variant == "accumulate" else 1
    stops = list(range(every, steps_total, every))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = launch_argv(
        "--cpu", "--num_processes", str(world), str(WORKER), str(tmp_path), ",".join(map(str, stops)), variant
    )
    proc = (
        run_launch(cmd, env=env)
        if world > 1
        else subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(world):
        diffs = json.loads((tmp_path / f"resume_rank{rank}.json").read_text())
        assert diffs == {str(k): 0.0 for k in stops}, f"rank {rank}: max |diff| per stop step: {diffs}"
