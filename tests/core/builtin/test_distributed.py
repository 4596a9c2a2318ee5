"""DDP and FSDP2 in 2 processes over gloo, started by `lowbit launch --cpu --num_processes 2`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TESTS, LaunchedOnce, launch_argv, mlp, regression_data, run_launch
from torch import nn

WORKER = TESTS / "distributed" / "worker.py"
pytestmark = pytest.mark.multiprocess


def launch_scenarios(folder: Path, scenarios: tuple[str, ...], *flags: str, world: int = 2, env_extra=None) -> dict:
    """One launch of worker.py running ``scenarios`` in turn; each one's per-rank results, by name
    (its files in ``folder / scenario``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env_extra or {}))
    cmd = launch_argv("--cpu", "--num_processes", str(world), *flags, str(WORKER), ",".join(scenarios), str(folder))
    proc = run_launch(cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {s: [json.loads((folder / s / f"result_rank{r}.json").read_text()) for r in range(world)] for s in scenarios}


def launch(tmp_path: Path, scenario: str, *flags: str, world: int = 2, env_extra: dict | None = None) -> list[dict]:
    """One scenario in a launch of its own; its files in ``tmp_path / scenario``."""
    return launch_scenarios(tmp_path, (scenario,), *flags, world=world, env_extra=env_extra)[scenario]


# Scenarios that share one launch, by its flags, run in turn (each with an Accelerator of its own):
# a launch costs about 7 CPU-seconds before any scenario runs (torchrun and two ranks starting).
TOGETHER = {
    (): ("ddp", "resume", "nonfinite", "comm-hook-fp16", "comm-hook-power_sgd"),
    ("--use_fsdp",): ("fsdp", "resume", "nonfinite", "tied-save"),
    ("--mixed_precision", "fp8"): ("fp8-ddp", "block-mxfp8-ddp"),
    ("--use_fsdp", "--mixed_precision", "fp8"): ("fp8-fsdp", "fp8-fsdp-resume", "block-mxfp8-fsdp"),
    # tests/plugins/deepspeed/test_deepspeed.py's
    ("--use_deepspeed", "--zero_stage", "2", "--mixed_precision", "bf16"): ("ds", "clip"),
    ("--use_deepspeed", "--zero_stage", "3", "--mixed_precision", "bf16"): ("ds", "clip", "resume"),
}


def shared_launches(tmp_path_factory):
    """``results(scenario, *flags)``: the scenario's per-rank results and its folder, from the launch
    of its TOGETHER group (once per test session: the first test to ask launches it)."""
    launched = LaunchedOnce(tmp_path_factory, "distributed")

    def results(scenario: str, *flags: str) -> tuple[list[dict], Path]:
        group = TOGETHER.get(flags, ())
        group = group if scenario in group else (scenario,)
        ran = launched((flags, group), lambda work: {"folder": str(work), **launch_scenarios(work, group, *flags)})
        return ran[scenario], Path(ran["folder"]) / scenario

    return results


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return shared_launches(tmp_path_factory)


def assert_loss_decreases(losses: list[float]) -> None:
    """The last epoch's mean loss is well below the first epoch's (4 steps per epoch)."""
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.7 * first, f"loss did not decrease: first epoch {first:.3f}, last epoch {last:.3f}"


def single_process_reference(epochs: int = 3) -> dict[str, torch.Tensor]:
    """The same model trained in one process on the same global batches (16 = 2 ranks x 8)."""
    model = mlp(seed=0, width=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = regression_data(64)
    for _ in range(epochs):
        for bx, by in zip(x.split(16), y.split(16)):
            opt.zero_grad()
            nn.functional.mse_loss(model(bx), by).backward()
            opt.step()
    return model.state_dict()


def gathered_states(out: Path, world: int = 2) -> list[dict]:
    """Each rank's ``get_state_dict``: whole on every rank under DDP; under FSDP2 on the main process
    only (the others get {}, and there is one sharded copy, so nothing to compare)."""
    states = [torch.load(out / f"state_rank{r}.pt", weights_only=True) for r in range(world)]
    assert states[0], "the main process must hold the whole model"
    return [state for state in states if state]


def assert_ranks_agree(states: list[dict]) -> None:
    for other in states[1:]:
        for key in states[0]:
            assert torch.equal(states[0][key], other[key]), f"{key} differs between ranks"


def assert_ranks_agree_and_match_reference(folder: Path, results, atol=1e-5):
    states = gathered_states(folder)
    assert_ranks_agree(states)
    reference = single_process_reference()
    for key, value in reference.items():
        torch.testing.assert_close(states[0][key], value, atol=atol, rtol=1e-4)
    assert_loss_decreases(results[0]["losses"])


def test_ddp_two_processes_equal_single_process_training(shared):
    results, folder = shared("ddp")
    assert results[0]["strategy"] == "ddp" and results[0]["world_size"] == 2
    assert_ranks_agree_and_match_reference(folder, results)


def test_fsdp2_two_processes_shard_parameters_and_match(shared):
    results, folder = shared("fsdp", "--use_fsdp")
    assert results[0]["strategy"] == "fsdp"
    full_bytes = sum(p.numel() * 4 for p in mlp(width=64).parameters())
    for r in results:
        ratio = r["param_bytes"] / full_bytes
        print(f"FSDP2 rank param bytes / full model: {ratio:.3f}")
        assert 0.45 <= ratio <= 0.55
    assert_ranks_agree_and_match_reference(folder, results)


def test_fp8_under_ddp(shared):
    pytest.importorskip("lowbit_ao")
    results, _ = shared("fp8-ddp", "--mixed_precision", "fp8")
    assert results[0]["fp8_backend"] == "ao"
    assert_loss_decreases(results[0]["losses"])


def test_fp8_under_fsdp2_gathers_weights_in_float8_by_default(shared):
    """As Accelerate's default Float8LinearConfig: FSDP2 all-gathers the converted weights in float8,
    and the FP8 report says how many."""
    pytest.importorskip("lowbit_ao")
    results, _ = shared("fp8-fsdp", "--use_fsdp", "--mixed_precision", "fp8")
    assert results[0]["fp8_backend"] == "ao" and results[0]["strategy"] == "fsdp"
    assert "WeightWithDynamicFloat8CastTensor" in results[0]["weight_types"]  # float8 all-gather is on
    assert "weights all-gathered in fp8: 2 of 2" in results[0]["fp8_report"], results[0]["fp8_report"]
    assert_loss_decreases(results[0]["losses"])


def test_fp8_under_fsdp2_with_shards_of_unequal_size_gathers_those_weights_in_high_precision(tmp_path):
    """torchao's float8 all-gather aborts the job when a weight's first dimension does not divide by
    the ranks (pytorch/ao#3982; 64 rows over 3 ranks): lowbit gathers those weights in high
    precision, says so, and the run trains."""
    pytest.importorskip("lowbit_ao")
    results = launch(tmp_path, "fp8-fsdp", "--use_fsdp", "--mixed_precision", "fp8", world=3)
    assert "WeightWithDynamicFloat8CastTensor" not in results[0]["weight_types"]
    assert "weights all-gathered in fp8: 0 of 2" in results[0]["fp8_report"], results[0]["fp8_report"]
    assert_loss_decreases(results[0]["losses"])


def test_fp8_fsdp2_float8_all_gather_saves_and_resumes_exactly_on_the_same_accelerator(shared):
    """save_state pickles the float8 all-gather weights' config (it crashed: a class made at run
    time), and load_state recomputes the precomputed scales from the loaded weights (they were
    stale until the next step)."""
    pytest.importorskip("lowbit_ao")
    results, _ = shared("fp8-fsdp-resume", "--use_fsdp", "--mixed_precision", "fp8")
    assert all(r["resumed_equals_uninterrupted"] for r in results), results


@pytest.mark.parametrize("recipe, precision", [("mxfp8", "fp8"), ("nvfp4", "fp4")])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_block_formats_under_ddp_and_fsdp2(shared, recipe, precision, strategy):
    """MXFP8 (torchao, emulated kernels) and NVFP4 (lowbit-ao's emulation) train in 2 processes,
    with the ranks ending on the same weights."""
    pytest.importorskip("lowbit_ao")
    flags = ["--use_fsdp"] if strategy == "fsdp" else []
    scenario = f"block-{recipe}-{strategy}"
    results, folder = shared(scenario, *flags, "--mixed_precision", precision)
    assert results[0]["strategy"] == strategy and results[0]["fp8_backend"] == "ao"
    assert results[0]["fp8_report"].startswith(f"{precision} (ao, {recipe}, emulated): 2 of 4 Linear layers"), results[
        0
    ]["fp8_report"]
    assert_ranks_agree(gathered_states(folder))
    assert_loss_decreases(results[0]["losses"])


@pytest.mark.parametrize(
    "flags",
    [("--use_fsdp",), ("--use_deepspeed", "--zero_stage", "3", "--mixed_precision", "bf16")],
    ids=["fsdp2", "zero3"],
)
def test_a_sharded_model_is_gathered_on_the_main_process_only_and_a_tied_weight_saved_once(shared, flags):
    if "--use_deepspeed" in flags:
        pytest.importorskip("lowbit_deepspeed")
        pytest.importorskip("deepspeed")
    results, folder = shared("tied-save", *flags)
    assert results[0]["state_names"] == ["embed.weight", "head.weight", "mid.bias", "mid.weight"]
    assert results[0]["tied_shared"] is True
    assert results[1]["state_names"] == []  # the other rank took part in the gather and kept nothing
    from safetensors.torch import load_file

    written = load_file(folder / "model" / "model.safetensors")
    assert sorted(written) == ["embed.weight", "mid.bias", "mid.weight"]  # head.weight: the same tensor, once
    full = torch.load(folder / "full_state.pt", weights_only=True)
    assert torch.equal(written["embed.weight"], full["head.weight"].to(written["embed.weight"].dtype))


def test_two_process_checkpoint_resume_matches_uninterrupted_run(shared):
    results, _ = shared("resume")
    assert all(r["resumed_equals_uninterrupted"] for r in results)


def test_fsdp2_checkpoint_resume(shared):
    results, _ = shared("resume", "--use_fsdp")
    assert all(r["resumed_equals_uninterrupted"] for r in results)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(shared, strategy):
    results, folder = shared("nonfinite", *(["--use_fsdp"] if strategy == "fsdp" else []))
    assert [r["skipped"] for r in results] == [[False, False, True, False]] * 2
    states = gathered_states(folder)
    assert_ranks_agree(states)
    assert all(torch.isfinite(value).all() for value in states[0].values())


@pytest.mark.parametrize("hook, registered", [("fp16", "fp16_compress_hook"), ("power_sgd", "powerSGD_hook")])
def test_ddp_comm_hooks_are_registered_and_train(shared, hook, registered):
    results, _ = shared(f"comm-hook-{hook}")
    assert all(registered in (r["comm_hook"] or "") for r in results), [r["comm_hook"] for r in results]
    assert_loss_decreases(results[0]["losses"])


def test_ranks_come_from_a_process_group_the_script_started_itself(tmp_path):
    """With no RANK variable both processes said they were rank 0 (lowbit read the environment only)."""
    worker = TESTS / "distributed" / "own_group_worker.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(worker), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert facts == [
        {"process_index": 0, "num_processes": 2, "is_main_process": True},
        {"process_index": 1, "num_processes": 2, "is_main_process": False},
    ]


@pytest.mark.parametrize("flags", [(), ("--use_fsdp",)], ids=["ddp", "fsdp2"])
def test_torch_compile_of_a_prepared_model_adds_nothing_to_what_torch_compiles(tmp_path, flags):
    """torch.compile of a prepared model under DDP and FSDP2 (every default on, the meter included;
    a shuffled loader) against the same model wrapped by torch itself, compiled the same way: lowbit
    adds no graph break, and no precision recompiles after the first step. (Torch's own DDP and
    FSDP2 wrappers break the graph on a CPU over gloo; that is torch's, measured beside it.)"""
    out = tmp_path / "compile"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    precisions = "no,bf16,fp16,fp8-tensorwise,fp8-rowwise"
    cmd = launch_argv(
        "--cpu", "--num_processes", "2", *flags, str(TESTS / "distributed" / "compile_worker.py"), str(out), precisions
    )
    proc = run_launch(cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in range(2):
        results = json.loads((out / f"result_rank{rank}.json").read_text())
        assert results.pop("strategy") == ("FSDP" if flags else "MULTI_CPU")
        plain = results.pop("torch")
        for precision, seen in results.items():
            assert seen["graph_breaks"] <= plain["graph_breaks"], (precision, seen, plain)
            assert seen["graphs"] == seen["graphs_after_first_step"] >= plain["graphs"], (precision, seen, plain)
            assert seen["finite"] and seen["steps"] == 11, (precision, seen)
