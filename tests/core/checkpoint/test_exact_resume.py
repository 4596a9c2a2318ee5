"""Killed at any step and resumed from its checkpoint (mid-epoch included, with Accelerate's
``skip_first_batches`` pattern), a run ends on weights bit-identical to an uninterrupted one:
the epoch's shuffle order, dropout's RNG, the scheduler and the optimizer all continue exactly."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
from helpers import TESTS, launch_argv, run_launch

WORKER = TESTS / "distributed" / "resume_worker.py"
_spec = importlib.util.spec_from_file_location("resume_worker", WORKER)
resume_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resume_worker)
pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("world", [1, 2])
def test_kill_and_resume_at_every_step_is_bit_identical(tmp_path, world):
    """Saved right after each step, inside the loop; at an epoch's last step that resumed into the
    next epoch with the finished epoch's shuffle order (epoch 0's again). With gradient
    accumulation, at every optimizer step (a save between micro-steps keeps no gradients, as in
    Accelerate). Every variant of resume_worker.py in one launch, each with its own Accelerator."""
    variants = [v for v in resume_worker.VARIANTS if v != "fp8" or importlib.util.find_spec("lowbit_ao")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = launch_argv("--cpu", "--num_processes", str(world), str(WORKER), ",".join(variants), str(tmp_path))
    proc = (
        run_launch(cmd, env=env)
        if world > 1
        else subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    differ = {}  # variant and rank: max |diff| per stop step, where a resumed run did not end bit-identical
    for variant in variants:
        stops = resume_worker.stop_steps(variant, world)
        assert len(stops) >= 7, stops  # kills in each of the 3 epochs (5 to 10 steps each)
        for rank in range(world):
            diffs = json.loads((tmp_path / variant / f"resume_rank{rank}.json").read_text())
            if diffs != {str(k): 0.0 for k in stops}:
                differ[f"{variant}, rank {rank}"] = diffs
    assert not differ, differ
