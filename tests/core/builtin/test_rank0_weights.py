"""Weights only rank 0 holds reach every rank at prepare() (Accelerate's fsdp_sync_module_states
and fsdp_cpu_ram_efficient_loading), under FSDP2 and DDP, on 2 CPU processes: after prepare every
rank's whole weights equal the checkpoint's exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import TESTS, launch_argv, run_launch

WORKER = str(TESTS / "distributed" / "rank0_weights_worker.py")
FSDP_FROM_RANK0 = ("--use_fsdp", "--fsdp_cpu_ram_efficient_loading", "true")


def _run(tmp_path: Path, *flags_and_args: str, worker_args: tuple[str, ...]) -> tuple[list[dict], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", LOWBIT_CONFIG_FILE=os.devnull)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    command = launch_argv("--cpu", "--num_processes", "2", *flags_and_args, WORKER, str(out), *worker_args)
    proc = run_launch(command, env=env, cwd=tmp_path, timeout=900)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))] if proc.returncode == 0 else []
    assert proc.returncode == 0 or not reports
    return reports, proc.stderr if proc.returncode else ""


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "flags, mode",
    [
        (FSDP_FROM_RANK0, "empty"),
        (("--use_fsdp", "--fsdp_sync_module_states", "true"), "scrambled"),
        ((), "empty"),  # DDP: the ranks under init_empty_weights are allocated, then DDP's broadcast
    ],
)
def test_every_rank_ends_with_rank0s_weights(tmp_path, flags, mode):
    reports, err = _run(tmp_path, *flags, worker_args=(mode,))
    assert len(reports) == 2, err[-3000:]
    assert [r["max_diff"] for r in reports] == [0.0, 0.0] and all(r["compared"] == 9 for r in reports)
    if mode == "empty":
        assert [r["unloaded_before"] for r in reports] == [False, True]


@pytest.mark.multiprocess
def test_a_from_pretrained_llama_is_the_checkpoint_on_every_rank_after_prepare(tmp_path):
    """A bf16-stored checkpoint loaded in fp32; rank 1's weights scrambled after loading: under
    `--fsdp_cpu_ram_efficient_loading true` transformers sees Accelerate's variables, and prepare()
    gives every rank the checkpoint's weights, with FP8 (ao) converting after the fill."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("lowbit_ao")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    reports, err = _run(
        tmp_path, *FSDP_FROM_RANK0, "--mixed_precision", "fp8", "--fp8_backend", "ao",
        worker_args=("pretrained", str(tmp_path / "ckpt")),
    )  # fmt: skip
    assert len(reports) == 2, err[-3000:]
    assert all(r["transformers_loads_once_per_machine"] for r in reports)
    assert [r["max_diff"] for r in reports] == [0.0, 0.0] and not reports[0]["missing"]


@pytest.mark.multiprocess
def test_unloaded_weights_under_fsdp_without_the_setting_are_refused_by_name(tmp_path):
    reports, err = _run(tmp_path, "--use_fsdp", worker_args=("empty",))
    assert not reports and "fsdp_cpu_ram_efficient_loading" in err and "meta device" in err


def test_the_launcher_exports_what_transformers_reads(tmp_path, monkeypatch):
    import sys

    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    monkeypatch.setenv("LOWBIT_CONFIG_FILE", os.devnull)
    script = tmp_path / "train.py"
    script.write_text("")
    args = build_parser().parse_args(["launch", "--cpu", "--num_processes", "2", *FSDP_FROM_RANK0, str(script)])
    _, env, config = build_command(args)
    assert config.fsdp_config["cpu_ram_efficient_loading"] is True
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_CPU_RAM_EFFICIENT_LOADING"], env["FSDP_SYNC_MODULE_STATES"]) == (
        "true",
        "true",
        "true",
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", [(), FSDP_FROM_RANK0], ids=["ddp", "fsdp2"])
def test_tied_weights_are_filled_and_stay_tied(tmp_path, flags):
    """to_empty untied the head from its embedding on the ranks being filled: their broadcasts
    stopped pairing with rank 0's and the job hung."""
    reports, err = _run(tmp_path, *flags, worker_args=("tied",))
    assert len(reports) == 2, err[-3000:]
    assert [r["max_diff"] for r in reports] == [0.0, 0.0]
    if not flags:
        assert all(r["tied_after"] for r in reports)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, said", [("tied-bf16", "bfloat16"), ("tied-wider", "[64, 48]")])
def test_ranks_whose_models_differ_are_refused_by_name_not_hung(tmp_path, mode, said):
    reports, err = _run(tmp_path, worker_args=(mode,))
    assert not reports
    assert "rank 1's model is not rank 0's (embed.weight: float32 [64, 32] on rank 0" in err, err[-3000:]
    assert said in err
