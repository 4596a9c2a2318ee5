"""transformers' Trainer and TRL's SFTTrainer and DPOTrainer, unmodified (trainer_worker.py), on
lowbit and on stock Accelerate side by side: started by ``lowbit launch`` (no code change), by
``python`` with the one documented line, and by ``python``/``torchrun`` alone (stock).

Each run is launched once and shared by the checks (``Runs``): 25 launches, about 4 minutes on 2
idle cores; the 2-process ones hold lowbit's collectives to NCCL's device rule.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import LaunchedOnce, launch_argv, run_launch

pytest.importorskip("transformers")
pytest.importorskip("trl")

WORKER = Path(__file__).parent / "trainer_worker.py"
# The FP8 tests' bound for fp8 against bf16 (tests/test_transformers_models.py); measured here: < 0.001.
FP8_LOSS_TOLERANCE = 0.02
# FSDP2 against DDP in bf16 (different reduction order and dtype); measured: < 1e-4.
STRATEGY_TOLERANCE = 0.01

# Runs another project's code (Trainer/TRL, Accelerate's own suite, transformers models): CI's third-party lane.
pytestmark = [pytest.mark.multiprocess, pytest.mark.third_party]


class Runs:
    """Launch each (how, processes, script arguments) once per test session, on first use; the
    per-rank results, the launch's stderr and its output folder."""

    def __init__(self, launched: LaunchedOnce):
        self.launched = launched

    def __call__(
        self,
        how: str,
        *args: str,
        processes: int = 1,
        precision: str | None = None,
        resume: str | None = None,
        env_extra: tuple[tuple[str, str], ...] = (),
    ):
        def launch(out: Path):
            script = [str(WORKER), str(out), *args, *(["--resume", resume] if resume else [])]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_"))}
            env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **dict(env_extra))
            if how == "lowbit":  # the unmodified script under lowbit launch
                cmd = launch_argv(
                    "--cpu",
                    "--num_processes",
                    str(processes),
                    *(["--mixed_precision", precision] if precision else []),
                    *script,
                )
            else:  # stock Accelerate ("stock"), or lowbit by the script's one line ("line")
                assert precision is None
                starter = (
                    [sys.executable]
                    if processes == 1
                    else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
                )
                cmd = [*starter, *script, *(["--lowbit-line"] if how == "line" else [])]
            proc = run_launch(cmd, env=env)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
            results = [json.loads((out / f"result_{rank}.json").read_text()) for rank in range(processes)]
            return results, proc.stderr, str(out)

        results, stderr, out = self.launched((how, processes, precision, resume, args, env_extra), launch)
        return results, stderr, Path(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(LaunchedOnce(tmp_path_factory, "trainer_runs"))


def same_training(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["eval_losses"] == b["eval_losses"], (a["losses"], b["losses"])
    assert len(a["losses"]) == 4 and len(a["eval_losses"]) == 2


def every_parameter_trained(result: dict) -> None:
    """The optimizer holds every trainable parameter of the converted model, and each one moved:
    stock Accelerate + Trainer + torchao FP8 leaves the FP8 layers' weights out of the optimizer."""
    assert result["optimizer_params"] == result["trainable_params"] == 21
    assert len(result["moved"]) == result["trainable_params"]


# ---------------------------------------------------------------------- one process


def test_an_unmodified_trainer_script_under_lowbit_launch_is_bit_identical_to_stock(runs):
    """fp32, gradient accumulation 2, an eval set of 32 rows in batches of 5 (the last batch short:
    Trainer relies on gather_for_metrics and the gradient state's remainder), a checkpoint at step 10."""
    (stock,), _, _ = runs("stock")
    (ours,), stderr, _ = runs("lowbit")
    same_training(stock, ours)
    assert stock["accelerator"] == "accelerate.accelerator.Accelerator"
    assert ours["accelerator"] == "lowbit.integrations.transformers.trainer_accelerator.TrainerAccelerator"
    first = next(line for line in stderr.splitlines() if line.startswith("lowbit:"))
    assert "Trainer runs on lowbit's Accelerator: fp32" in first
    # lowbit's figures reach every reporting integration and the console, and log_history stays
    # what stock writes (a run and its resume, or two identical runs, compare equal)
    assert {"throughput/tokens_per_s", "throughput/mfu", "throughput/step_s"} <= set(ours["reported_keys"])
    assert ours["log_keys"] == stock["log_keys"]


def test_the_documented_line_puts_a_python_started_script_on_lowbit(runs):
    (stock,), _, _ = runs("stock", "--bf16")
    (ours,), _, _ = runs("line", "--bf16")
    same_training(stock, ours)
    assert ours["accelerator"].startswith("lowbit.") and ours["mixed_precision"] == "bf16"


def test_fp8_asked_of_the_launcher_trains_every_layer_and_wins_over_bf16_with_a_note(runs):
    (bf16,), _, _ = runs("stock", "--bf16")
    (fp8,), stderr, out = runs("lowbit", "--bf16", precision="fp8")
    assert (fp8["mixed_precision"], fp8["fp8_backend"]) == ("fp8", "ao")
    every_parameter_trained(fp8)
    assert abs(fp8["losses"][-1] - bf16["losses"][-1]) <= FP8_LOSS_TOLERANCE
    assert abs(fp8["eval_losses"][-1] - bf16["eval_losses"][-1]) <= FP8_LOSS_TOLERANCE
    assert fp8["fp8_gemm_share"] > 0.5  # 13 of 15 Linear layers convert: most GEMM FLOPs run in FP8
    lines = [line for line in stderr.splitlines() if line.startswith("lowbit:")]
    assert "runs on lowbit's Accelerator: fp8 by the 'ao' backend" in lines[0]
    assert any("wins over the Trainer's bf16" in line for line in lines)


def test_a_checkpoint_trainer_wrote_under_fp8_loads_into_a_plain_model_and_resumes_exactly(runs):
    from transformers import LlamaForCausalLM

    (fp8,), _, out = runs("lowbit", "--bf16", precision="fp8")
    plain, info = LlamaForCausalLM.from_pretrained(out / "checkpoint-10", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    (resumed,), _, _ = runs("lowbit", "--bf16", precision="fp8", resume=str(out / "checkpoint-10"))
    assert resumed["losses"] == fp8["losses"] and resumed["eval_losses"] == fp8["eval_losses"]


@pytest.mark.parametrize("trl_trainer", ["sft", "dpo"])
def test_trl_trainers_on_lowbit_match_stock_in_bf16_and_train_every_layer_in_fp8(runs, trl_trainer):
    (stock,), _, _ = runs("stock", "--trainer", trl_trainer, "--bf16")
    (ours,), _, _ = runs("lowbit", "--trainer", trl_trainer, "--bf16")
    same_training(stock, ours)
    (fp8,), _, _ = runs("lowbit", "--trainer", trl_trainer, "--bf16", precision="fp8")
    every_parameter_trained(fp8)
    # SFTTrainer replaces the model's forward with one closing over the original: the count still reads the layers
    assert fp8["fp8_gemm_share"] > 0.5
    assert abs(fp8["losses"][-1] - stock["losses"][-1]) <= FP8_LOSS_TOLERANCE


# PEFT LoRA (r=8 on the 14 projections of the tiny Llama): the adapters stay nn.Linear, 13 of the 14 bases
# are frozen FP8 bases (the first, layers.0.q_proj, is the first/last rule's), lm_head stays nn.Linear.
LORA_LAYERS = {"adapter": {"Linear": 28}, "base": {"FrozenFP8Linear": 13, "Linear": 1}, "other": {"Linear": 1}}


@pytest.mark.parametrize("kind", ["trainer", "sft", "dpo", "grpo"])
def test_lora_under_each_trainer_trains_in_fp8_saves_its_adapters_and_resumes(runs, kind):
    """Trainer with a PEFT model, SFTTrainer/DPOTrainer/GRPOTrainer with peft_config (GRPO generating
    with transformers, no vLLM), unmodified, under ``lowbit launch --mixed_precision fp8``."""
    (fp8,), _, out = runs("lowbit", "--trainer", kind, "--bf16", "--lora", precision="fp8")
    assert (fp8["mixed_precision"], fp8["layer_classes"]) == ("fp8", LORA_LAYERS)
    assert fp8["optimizer_params"] == fp8["trainable_params"] == 28 and len(fp8["moved"]) == 28
    assert (out / "checkpoint-10" / "adapter_model.safetensors").exists()
    (resumed,), _, _ = runs(
        "lowbit", "--trainer", kind, "--bf16", "--lora", precision="fp8", resume=str(out / "checkpoint-10")
    )
    assert resumed["losses"] == fp8["losses"] and resumed["eval_losses"] == fp8["eval_losses"]
    if kind != "grpo":  # GRPO's loss depends on what it samples, which FP8 changes: compared to itself only
        (stock,), _, _ = runs("stock", "--trainer", kind, "--bf16", "--lora")
        assert abs(fp8["losses"][-1] - stock["losses"][-1]) <= FP8_LOSS_TOLERANCE


def test_lora_in_fp8_through_the_documented_line(runs):
    """``lowbit.patch_trainer()`` in the script, fp8 asked by Accelerate's own variable."""
    (line,), _, _ = runs(
        "line", "--trainer", "sft", "--bf16", "--lora", env_extra=(("ACCELERATE_MIXED_PRECISION", "fp8"),)
    )
    (launched,), _, _ = runs("lowbit", "--trainer", "sft", "--bf16", "--lora", precision="fp8")
    assert line["mixed_precision"] == "fp8" and line["layer_classes"] == LORA_LAYERS
    assert line["losses"] == launched["losses"]


# ---------------------------------------------------------------------- two processes


def test_ddp_under_trainer_matches_stock_in_bf16_and_trains_every_layer_in_fp8(runs):
    stock, _, _ = runs("stock", "--bf16", processes=2)
    ours, _, out = runs("lowbit", "--bf16", processes=2)
    for a, b in zip(stock, ours):
        same_training(a, b)
    assert ours[0]["distributed_type"] == "DistributedType.MULTI_CPU"
    resumed, _, _ = runs("lowbit", "--bf16", processes=2, resume=str(out / "checkpoint-10"))
    assert resumed[0]["losses"] == ours[0]["losses"] and resumed[0]["eval_losses"] == ours[0]["eval_losses"]
    fp8, _, _ = runs("lowbit", "--bf16", processes=2, precision="fp8")
    every_parameter_trained(fp8[0])
    assert abs(fp8[0]["losses"][-1] - stock[0]["losses"][-1]) <= FP8_LOSS_TOLERANCE


def test_fsdp2_through_training_arguments_in_bf16_and_fp8_saves_and_resumes(runs):
    """Stock Accelerate runs ``fsdp=`` on CPU processes as plain DDP (its distributed type stays
    MULTI_CPU), so lowbit's FSDP2 is compared with stock DDP within the strategies' tolerance."""
    stock_ddp, _, _ = runs("stock", "--bf16", processes=2)
    bf16, _, _ = runs("lowbit", "--bf16", "--fsdp", processes=2)
    assert bf16[0]["distributed_type"] == "DistributedType.FSDP"
    assert max(abs(a - b) for a, b in zip(bf16[0]["losses"], stock_ddp[0]["losses"])) <= STRATEGY_TOLERANCE
    fp8, _, out = runs("lowbit", "--bf16", "--fsdp", processes=2, precision="fp8")
    every_parameter_trained(fp8[0])
    assert (
        out / "checkpoint-10" / "pytorch_model_fsdp.bin"
    ).is_file()  # Trainer's FSDP checkpoint, Accelerate's layout
    resumed, _, _ = runs("lowbit", "--bf16", "--fsdp", processes=2, precision="fp8", resume=str(out / "checkpoint-10"))
    assert resumed[0]["losses"] == fp8[0]["losses"] and resumed[0]["eval_losses"] == fp8[0]["eval_losses"]


def test_fsdp2_cpu_ram_efficient_loading_under_trainer_starts_every_rank_from_the_checkpoint(runs, tmp_path):
    """A bf16-stored checkpoint, from_pretrained in fp32 with fsdp_config cpu_ram_efficient_loading,
    rank 1's loaded weights scrambled: when training begins (after prepare), both ranks hold the
    checkpoint's weights exactly, and training runs."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("trainer_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker.model().to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    results, _, _ = runs("lowbit", "--bf16", "--fsdp", "--pretrained", str(tmp_path / "ckpt"), processes=2)
    distances = [r["checkpoint_distance_at_start"] for r in results]
    assert [d["max_diff"] for d in distances] == [0.0, 0.0] and distances[0]["compared"] == 21
    assert len(results[0]["losses"]) == 4


@pytest.mark.parametrize("stage", ["2", "3"])
def test_deepspeed_zero_through_training_arguments_is_bit_identical_to_stock(runs, stage):
    stock, _, _ = runs("stock", "--bf16", "--deepspeed", stage, processes=2)
    ours, _, out = runs("lowbit", "--bf16", "--deepspeed", stage, processes=2)
    for a, b in zip(stock, ours):
        same_training(a, b)
    assert ours[0]["distributed_type"] == "DistributedType.DEEPSPEED"
    # the checkpoint DeepSpeed wrote (its own sharded files) resumes exactly
    resumed, _, _ = runs("lowbit", "--bf16", "--deepspeed", stage, processes=2, resume=str(out / "checkpoint-10"))
    assert resumed[0]["losses"] == ours[0]["losses"] and resumed[0]["eval_losses"] == ours[0]["eval_losses"]
