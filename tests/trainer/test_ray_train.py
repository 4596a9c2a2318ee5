"""transformers' Trainer under Ray Train (a local Ray cluster, 2 CPU workers), as Ray's Hugging
Face recipe writes it, with ``lowbit.patch_trainer()`` as the worker's first line: the same losses
as stock Accelerate, and with ``ACCELERATE_MIXED_PRECISION=fp8`` in Ray's runtime_env every layer
trains and FP8 runs on both workers. The three jobs run in turn on one Ray cluster
(tests/distributed/ray_train_job.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.train.torch")
pytest.importorskip("transformers")
# Runs another project's code (Trainer/TRL, Accelerate's own suite, transformers models): CI's third-party lane.
pytestmark = [pytest.mark.multiprocess, pytest.mark.third_party]

JOB = Path(__file__).resolve().parents[1] / "distributed" / "ray_train_job.py"


def test_trainer_under_ray_train_on_lowbit_matches_stock_and_trains_fp8(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_", "RAY_"))}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0")
    proc = subprocess.run(
        [sys.executable, str(JOB), str(tmp_path), "stock,lowbit,fp8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stock, ours, fp8 = (
        [json.loads((tmp_path / job / f"result_{rank}.json").read_text()) for rank in range(2)]
        for job in ("stock", "lowbit", "fp8")
    )
    assert {r["accelerator"] for r in ours} == {
        "lowbit.integrations.transformers.trainer_accelerator.TrainerAccelerator"
    }
    assert stock[0]["accelerator"] == "accelerate.accelerator.Accelerator"
    assert {r["mixed_precision"] for r in stock + ours} == {"no"}  # the cluster's fp8 set back in their workers
    assert [r["losses"] for r in ours] == [r["losses"] for r in stock] and ours[0]["eval_losses"] == stock[0][
        "eval_losses"
    ]
    for result in fp8:
        assert (result["mixed_precision"], result["fp8_backend"]) == ("fp8", "ao")
        assert result["optimizer_params"] == result["trainable_params"] == len(result["moved"]) == 21
        assert result["fp8_gemm_share"] and result["fp8_gemm_share"] > 0.5
