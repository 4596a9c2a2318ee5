"""FP8 LoRA in 2 CPU processes (lora_worker.py, started by ``lowbit launch``): FSDP2 shards the frozen
FP8 bases and all-gathers them in FP8, 1 byte an element; DDP buckets the adapters' gradients only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import launch_argv, run_launch

pytest.importorskip("torchao")
pytest.importorskip("peft")
pytest.importorskip("transformers")

pytestmark = pytest.mark.multiprocess
WORKER = Path(__file__).parent / "lora_worker.py"


def launch(out: Path, frozen_bases: str, *flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = launch_argv(
        "--cpu", "--num_processes", "2", *flags, "--mixed_precision", "fp8", str(WORKER), str(out), frozen_bases
    )
    proc = run_launch(cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"result_{rank}.json").read_text()) for rank in range(2)]


def test_fsdp2_shards_frozen_fp8_bases_and_gathers_them_in_fp8(tmp_path):
    fp8 = launch(tmp_path / "fp8", "fp8", "--use_fsdp")
    high = launch(tmp_path / "high", "high_precision", "--use_fsdp")
    for run in (fp8, high):
        assert run[0]["strategy"] == "FSDP"
        assert run[0]["adapter_checksum"] == run[1]["adapter_checksum"]  # the ranks agree
    # in the forward, the gathered frozen base is whole and still FP8 (FSDP2's bf16 policy did not cast it)
    assert fp8[0]["frozen_base_in_forward"] == {"FrozenFP8Linear": ["torch.float8_e4m3fn", [512, 256]]}
    assert high[0]["frozen_base_in_forward"] == {"Linear": ["torch.bfloat16", [512, 256]]}
    # each element of a frozen FP8 base moves 1 byte per all-gather instead of bf16's 2 (gathered in the
    # forward and again in the backward, as FSDP2 reshards after the forward)
    saved = high[0]["gathered_bytes"] - fp8[0]["gathered_bytes"]
    elements = fp8[0]["frozen_fp8_elements"]
    assert elements > 10**6 and saved == 2 * elements, (saved, elements)
    assert abs(fp8[0]["losses"][-1] - high[0]["losses"][-1]) < 0.05 * high[0]["losses"][-1]


def test_ddp_buckets_only_the_adapters_gradients_and_every_rank_holds_rank0s_fp8_bases(tmp_path):
    (rank0, rank1) = launch(tmp_path / "ddp", "fp8")
    assert rank0["frozen_base_in_forward"] == {"FrozenFP8Linear": ["torch.float8_e4m3fn", [512, 256]]}
    assert sum(int(size) for size in rank0["ddp_bucket_sizes"].split(",")) == rank0["trainable_bytes"]
    assert rank0["adapter_checksum"] == rank1["adapter_checksum"]
    assert rank0["losses"][-1] < rank0["losses"][0]
