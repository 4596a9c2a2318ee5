"""Context parallelism on CUDA GPUs (torch's ``context_parallel``; torch has no CPU rule for its
attention kernel, so CPU runs refuse cp_size > 1): ``pytest -m gpu tests/core/builtin/test_parallelism_gpu.py``.

Needs 2 CUDA GPUs (NCCL puts one rank on each); skipped otherwise. Not run in this repository's CI
(it has no GPU); ``bench/gpu_check.sh`` runs it where the machine has two.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import TESTS, launch_argv, run_launch, tiny_llama

SCRIPT = TESTS / "accelerate_style" / "nd_parallel.py"
transformers = pytest.importorskip("transformers")
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="context parallelism needs 2 CUDA GPUs (one NCCL rank on each)",
)


@pytest.mark.gpu
@pytest.mark.multiprocess
@two_gpus
def test_context_parallel_trains_a_llama_with_each_rank_holding_half_of_every_sequence(tmp_path):
    tiny_llama(use_cache=False).save_pretrained(tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    cmd = launch_argv(
        "--num_processes",
        "2",
        "--use_fsdp",
        str(SCRIPT),
        str(tmp_path / "tiny"),
        str(tmp_path / "out"),
        "--cp-size",
        "2",
    )
    proc = run_launch(cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["steps"] == 8 and all(loss == loss for loss in result["losses"])  # cp ranks share each batch
