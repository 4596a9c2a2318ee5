"""The one-rank NCCL paths on a real GPU (issue #46): ``pytest -m gpu tests/core/training/test_multi_gpu_rules_gpu.py``.

One CUDA GPU is enough: ``lowbit launch --multi_gpu --num_processes 1`` (DDP) and ``--use_fsdp
--num_processes 1`` (FSDP2) start one rank under torchrun that joins an NCCL process group alone.
The same worker runs in CPU CI on two gloo processes (test_multi_gpu_rules.py). Skipped without CUDA.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import TESTS, launch_argv, run_launch

WORKER = TESTS / "distributed" / "loader_worker.py"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)"),
]


def launch_one_rank(tmp_path, scenario: str, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    cmd = launch_argv("--num_processes", "1", *flags, str(WORKER), scenario, str(tmp_path))
    proc = run_launch(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp_path / scenario / "rank0.json").read_text())


@pytest.mark.parametrize("flag, strategy", [("--multi_gpu", "ddp"), ("--use_fsdp", "fsdp")])
def test_one_rank_over_nccl_trains_from_a_shuffled_loader_in_workers_with_pinned_memory(tmp_path, flag, strategy):
    result = launch_one_rank(tmp_path, "train", flag)
    assert result["device"] == "cuda" and result["strategy"] == strategy, result
    assert result["batch_devices"] == ["cuda"] and result["pid"] not in result["loader_pids"]
    assert sum(result["losses"][-4:]) < 0.5 * sum(result["losses"][:4]), result["losses"]


def test_nccl_refuses_a_host_tensor_and_the_hop_puts_it_on_the_gpu(tmp_path):
    """The rule the CPU simulation holds lowbit to, seen on the real backend: NCCL refuses a CPU
    tensor; on_group_device copies it to the GPU, and the broadcast state comes back intact."""
    result = launch_one_rank(tmp_path, "hop", "--multi_gpu")
    assert result["backend"] == "nccl" and result["hop_device"] == "cuda" and result["back_equal"], result
    assert result["host_tensor_taken"] is False, result
