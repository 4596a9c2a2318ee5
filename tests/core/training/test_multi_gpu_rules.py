"""What several GPUs under NCCL require of lowbit, checked on CPU processes (issue #46): the device
rule of NCCL's collectives (held by LOWBIT_SIMULATE_NCCL, which every launched test sets), and the
prepared DataLoader loading in the user's workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TESTS, LaunchedOnce, launch_argv, run_launch

from lowbit.runtime import collective_device

WORKER = TESTS / "distributed" / "loader_worker.py"
FSDP_WORKER = TESTS / "distributed" / "fsdp_worker.py"


def launch_scenarios(folder: Path, scenarios: tuple[str, ...], *flags: str, worker: Path = WORKER) -> dict:
    """One launch of ``worker`` running ``scenarios`` in turn: each one's per-rank results, by name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = launch_argv("--cpu", "--num_processes", "2", *flags, str(worker), ",".join(scenarios), str(folder))
    proc = run_launch(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {s: [json.loads((folder / s / f"rank{r}.json").read_text()) for r in range(2)] for s in scenarios}


def launch(tmp_path: Path, scenario: str, *flags: str, worker: Path = WORKER) -> list[dict]:
    """One scenario in a launch of its own."""
    return launch_scenarios(tmp_path, (scenario,), *flags, worker=worker)[scenario]


# Scenarios that share one launch (by worker and flags), run in turn, each with an Accelerator of
# its own: a launch costs about 7 CPU-seconds before any scenario runs. hop-reverted takes the
# device hop out of lowbit's collectives for the rest of its process: it runs alone.
TOGETHER = {
    (WORKER.name, ()): ("plain", "nccl-rules", "workers", "dispatch-strings", "user-gather", "train", "hop"),
    (FSDP_WORKER.name, ("--use_fsdp",)): ("placement", "sync-each-batch", "moe", "shared"),
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(scenario, *flags, worker=...)``: the scenario's per-rank results, from the launch of
    its TOGETHER group (once per test session: the first test to ask launches it)."""
    launched = LaunchedOnce(tmp_path_factory, "multi_gpu_rules")

    def results(scenario: str, *flags: str, worker: Path = WORKER) -> list[dict]:
        group = TOGETHER.get((worker.name, flags), ())
        group = group if scenario in group else (scenario,)
        return launched((worker.name, flags, group), lambda work: launch_scenarios(work, group, *flags, worker=worker))[
            scenario
        ]

    return results


@pytest.mark.multiprocess
def test_the_simulated_nccl_rule_catches_a_host_tensor_in_a_lowbit_collective(tmp_path, shared):
    """With the device hop taken out of broadcast (item 1 of #46 as it was: the sampler's CPU
    generator state broadcast as it is), the simulated group refuses the collective on both
    ranks, as NCCL did on GPUs; with the hop the same loader shuffles the same order everywhere."""
    reverted = launch(tmp_path, "hop-reverted")
    for rank in reverted:
        assert "NcclRuleError" in rank["error"] and "broadcast" in rank["error"], rank
        assert "lowbit.runtime.training.operations" in rank["error"]

    fixed = shared("plain")
    for epoch in ("epoch0", "epoch1"):
        items = [rank[epoch]["items"] for rank in fixed]
        assert sorted(items[0] + items[1]) == list(range(32)), "the ranks' shards must cover the dataset once"
    assert fixed[0]["epoch0"]["items"] != fixed[0]["epoch1"]["items"], "each epoch draws a new order"


@pytest.mark.multiprocess
def test_the_simulated_nccl_rule_holds_shapes_dtypes_and_contiguity(shared):
    """NCCL's whole rule on a CPU: shapes that differ between ranks (NCCL hangs or reads past the
    smaller buffer; the simulation names both), and what lowbit's own collectives now do for NCCL:
    an int16 tensor travels as int32, a transposed one contiguous (both refused by NCCL before)."""
    ranks = shared("nccl-rules")
    for rank in ranks:
        assert rank["shapes"].startswith("NcclRuleError") and "(2,)" in rank["shapes"] and "(3,)" in rank["shapes"]
        assert "on rank 0" in rank["shapes"] and "on rank 1" in rank["shapes"]
        assert rank["int16"] == "[2, 2]"
        assert rank["transposed"] == [[0.0, 6.0], [2.0, 8.0], [4.0, 10.0]]


def test_processes_that_would_share_a_gpu_are_refused(monkeypatch):
    """4 processes on a machine whose processes all see 2 GPUs: rank % GPUs put two on each
    ("Duplicate GPU" in NCCL later). One GPU each by CUDA_VISIBLE_DEVICES is fine."""
    from lowbit.kernel.errors import ConfigError

    from lowbit.runtime.process_group import _refuse_ranks_sharing_a_gpu

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match="4 processes on this machine but they see 2 GPU"):
        _refuse_ranks_sharing_a_gpu(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    _refuse_ranks_sharing_a_gpu(1)  # each process given its own GPU
    _refuse_ranks_sharing_a_gpu(4)


@pytest.mark.multiprocess
def test_the_loader_of_several_processes_loads_in_the_users_workers(shared):
    """num_workers=2 with pin_memory and persistent workers: each rank's items are read by two
    worker processes (before, by the training process itself), and every item once per epoch."""
    ranks = shared("workers")
    for rank in ranks:
        for epoch in ("epoch0", "epoch1"):
            pids = rank[epoch]["pids"]
            assert rank["pid"] not in pids and len(pids) == 2, rank
        assert rank["epoch0"]["pids"] == rank["epoch1"]["pids"], "persistent workers are kept between epochs"
    for epoch in ("epoch0", "epoch1"):
        assert sorted(ranks[0][epoch]["items"] + ranks[1][epoch]["items"]) == list(range(32))


@pytest.mark.multiprocess
def test_dispatched_batches_split_their_lists_of_names_with_their_tensors(shared):
    """split_batches with dispatch: rank 0 got ids [0, 1] with names s0..s3 (tensors were split,
    lists not); without split_batches the lists did not join. Each name stays with its id."""
    ranks = shared("dispatch-strings")
    for split in ("split=True", "split=False"):
        pairs = [pair for rank in ranks for batch in rank[split] for pair in batch]
        assert pairs and all(name == f"s{index}" for index, name in pairs), pairs
        assert {index for index, _ in pairs} == set(range(22))
        assert [len(batch) for batch in ranks[0][split]] == [len(batch) for batch in ranks[1][split]]


@pytest.mark.multiprocess
def test_a_scripts_cpu_tensors_gather_and_reduce_and_come_back_on_the_cpu(shared):
    ranks = shared("user-gather")
    for rank in ranks:
        assert rank["gathered"] == [0.0, 0.0, 1.0, 1.0] and rank["reduced"] == [1.0, 1.0]
        assert rank["device"] == "cpu"


def test_a_tensor_of_a_device_type_the_group_does_not_serve_moves_to_the_accelerator(monkeypatch):
    """Under NCCL (serves "cuda" only) a CPU tensor is copied to the process's accelerator (here
    the meta device stands in for it); a served type stays where it is, copied only when asked."""
    monkeypatch.delenv(collective_device.SIMULATE_ENV, raising=False)
    monkeypatch.setattr(collective_device, "_served_device_types", lambda: (frozenset({"cuda"}), torch.device("meta")))
    moved = collective_device.on_group_device(torch.ones(3))
    assert moved.device.type == "meta"
    monkeypatch.setattr(collective_device, "_served_device_types", lambda: (frozenset({"cpu", "cuda"}), None))
    tensor = torch.ones(3)
    assert collective_device.on_group_device(tensor) is tensor
    copied = collective_device.on_group_device(tensor, copy=True)
    assert copied is not tensor and torch.equal(copied, tensor)


# ---------------------------------------------------------------------- FSDP2


@pytest.mark.multiprocess
def test_fsdp2_prepare_never_puts_the_whole_unsharded_model_on_the_device(shared):
    """fully_shard moves each unit as it shards it; before, prepare() moved the whole model first
    (on a GPU: a model that fits only sharded ran out of memory there)."""
    ranks = shared("placement", "--use_fsdp", worker=FSDP_WORKER)
    for rank in ranks:
        assert rank["events"][0].startswith("fully_shard"), rank["events"]
        assert "whole model .to()" not in rank["events"], rank["events"]


@pytest.mark.multiprocess
def test_fsdp2_with_fp8_gathers_high_precision_weights_in_bf16(tmp_path):
    """Rowwise FP8 gathers no weight in float8: every weight comes gathered in bf16 (was fp32:
    twice the bytes); the shards the optimizer updates stay fp32."""
    ranks = launch(tmp_path, "gather-dtype", "--use_fsdp", "--mixed_precision", "fp8", worker=FSDP_WORKER)
    for rank in ranks:
        assert set(rank["weight_dtypes"].values()) == {"torch.bfloat16"}, rank["weight_dtypes"]
        assert rank["shard_dtypes"] == ["torch.float32"]


@pytest.mark.multiprocess
def test_sync_each_batch_reduces_the_gradients_of_a_micro_batch_that_does_not_step(shared):
    """GradientAccumulationPlugin(sync_each_batch=True) under FSDP2: the first of two micro-batches
    reduce-scatters its gradients (before, they waited unsharded for the stepping micro-batch)."""
    ranks = shared("sync-each-batch", "--use_fsdp", worker=FSDP_WORKER)
    for rank in ranks:
        assert rank["stepping"] is False and rank["reduced"] is True, rank


@pytest.mark.multiprocess
def test_fsdp2_shards_blocks_not_the_experts_inside_them(shared):
    """An MoE block's experts stay in the block's unit, so a rank whose tokens reach no token to an
    expert still joins the same collectives as the others (each rank routes to its own expert)."""
    ranks = shared("moe", "--use_fsdp", worker=FSDP_WORKER)
    for rank in ranks:
        assert rank["units"] == ["<root>", "layers.0", "layers.1"], rank["units"]
        assert len(rank["losses"]) == 3


@pytest.mark.multiprocess
def test_fsdp2_shards_a_block_listed_several_times_once_and_trains_as_ddp_does(tmp_path, shared):
    """ALBERT-style shared layers (one block three times in a ModuleList) with a tied head: prepare
    crashed ("fully_shard has already been applied"); DDP trained it. Each distinct module is one unit."""
    fsdp = shared("shared", "--use_fsdp", worker=FSDP_WORKER)
    (tmp_path / "ddp").mkdir()  # the same scenario again, under DDP
    ddp = launch(tmp_path / "ddp", "shared", worker=FSDP_WORKER)
    assert fsdp[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-4, abs=1e-5), (
        fsdp[0]["losses"],
        ddp[0]["losses"],
    )
    assert fsdp[0]["losses"][-1] < fsdp[0]["losses"][0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_model_freed_and_prepared_again_trains_as_one_preparation_does_and_ddp_joins_uneven_inputs(
    tmp_path, strategy
):
    """Trainer at each train() (and auto_find_batch_size at each retry): free_memory(), then
    prepare() of the same model object and of the optimizer prepare() returned. It stopped with
    "prepared by another Accelerator"; now it trains bit for bit as one preparation of 4 steps,
    in fp8 under FSDP2 and under DDP: neither converted nor laid out twice, the forward wrapped once."""
    flags = ["--mixed_precision", "fp8"] + (["--use_fsdp"] if strategy == "fsdp2" else [])
    # Under DDP the same launch runs join_uneven_inputs too: 5 batches of 2 ranks, even_batches=False
    # inside the block (3 and 2 batches, no hang), the loader filling up its last round again after.
    # Then a NaN on that lone step, the preemption poll at every step: the skipped step polls as the
    # joined rank's shadow does (a gloo collective mismatch crashed the job).
    scenarios = ("again",) if strategy == "fsdp2" else ("again", "join", "join-nan")
    ran = launch_scenarios(tmp_path, scenarios, *flags, worker=FSDP_WORKER)
    ranks = [{k: v for s in scenarios for k, v in ran[s][rank].items()} for rank in range(2)]
    if strategy == "ddp":
        assert [rank["join_batches"] for rank in ranks] == [3, 2] and ranks[1]["batches_after"] == 3, ranks
        assert [(rank["join_nan_batches"], rank["join_nan_skipped"]) for rank in ranks] == [(3, 1), (2, 0)], ranks
    for rank in ranks:
        assert rank["twice"] == rank["straight"], rank
        assert rank["forward_wrappers"] == 1, rank
        assert rank["type"] == ("FSDPSequential" if strategy == "fsdp2" else "DistributedDataParallel"), rank
        assert rank["layer"] != "Linear", rank  # the middle layers train in fp8 after the second preparation


# ---------------------------------------------------------------------- lowbit launch


def launch_command(tmp_path, monkeypatch, *flags: str, gpus: int = 4):
    """What ``lowbit launch <flags> train.py`` runs on a machine showing ``gpus`` GPUs."""
    from lowbit.cli import launch as launch_module
    from lowbit.cli.main import build_parser

    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.chdir(tmp_path)  # no config file in the working directory
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    monkeypatch.setattr(launch_module, "_visible_gpu_count", lambda: gpus)
    command, env, config = launch_module.build_command(build_parser().parse_args(["launch", *flags, str(script)]))
    return command, env, config


def test_launch_starts_one_process_per_visible_gpu_unless_told(tmp_path, monkeypatch):
    command, env, config = launch_command(tmp_path, monkeypatch)
    assert command[command.index("--nproc_per_node") + 1] == "4" and env["LOWBIT_DISTRIBUTED_TYPE"] == "MULTI_GPU"
    command, _, _ = launch_command(tmp_path, monkeypatch, "--num_processes", "2")
    assert command[command.index("--nproc_per_node") + 1] == "2"
    command, _, _ = launch_command(tmp_path, monkeypatch, gpus=1)
    assert "torch.distributed.run" not in command, "one GPU: a plain process"
    command, _, _ = launch_command(tmp_path, monkeypatch, "--cpu")
    assert "torch.distributed.run" not in command, "--cpu counts no GPU"


def test_gpu_ids_choose_the_gpus_and_the_process_count(tmp_path, monkeypatch):
    command, env, _ = launch_command(tmp_path, monkeypatch, "--gpu_ids", "1,3")
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and command[command.index("--nproc_per_node") + 1] == "2"
    _, env, _ = launch_command(tmp_path, monkeypatch, "--gpu_ids", "all")
    assert "CUDA_VISIBLE_DEVICES" not in env
    from lowbit.kernel.errors import ConfigError

    with pytest.raises(ConfigError, match="--gpu_ids 'first'"):
        launch_command(tmp_path, monkeypatch, "--gpu_ids", "first")


def test_gpu_ids_without_gpus_start_one_process_and_say_the_flag_does_nothing(tmp_path, monkeypatch, capsys):
    """On a machine without GPUs, --gpu_ids 0,1 started 2 processes (Accelerate starts 1)."""
    command, env, _ = launch_command(tmp_path, monkeypatch, "--gpu_ids", "0,1", gpus=0)
    assert "torch.distributed.run" not in command and "CUDA_VISIBLE_DEVICES" not in env
    assert "--gpu_ids 0,1 names GPUs, but this machine shows none" in capsys.readouterr().err


def test_gpu_ids_refuse_a_gpu_named_twice_and_more_processes_than_gpus(tmp_path, monkeypatch):
    """'0,0' put two ranks on one GPU; --num_processes 4 with --gpu_ids 0,1 wrapped ranks onto the
    same GPUs: NCCL's "Duplicate GPU" much later, or a hang."""
    from lowbit.kernel.errors import ConfigError

    with pytest.raises(ConfigError, match="names GPU 0 more than once"):
        launch_command(tmp_path, monkeypatch, "--gpu_ids", "0,0")
    with pytest.raises(ConfigError, match="gives 2 GPU\\(s\\) to 4 processes per machine"):
        launch_command(tmp_path, monkeypatch, "--gpu_ids", "0,1", "--num_processes", "4")


# ---------------------------------------------------------------------- launchers


@pytest.mark.multiprocess
def test_the_launchers_run_a_function_defined_where_no_file_holds_it(tmp_path):
    """A notebook cell's function lives in a __main__ with no file: notebook_launcher and
    debug_launcher fork (as Accelerate does); spawned processes could not find the function."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    with open(TESTS / "scripts" / "notebook_cell.py") as cell:
        proc = subprocess.run(
            [sys.executable, "-", str(tmp_path)],
            stdin=cell,
            capture_output=True,
            text=True,
            env={**env, "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for tag in ("notebook", "debug"):
        for rank in range(2):
            assert json.loads((tmp_path / f"{tag}{rank}.json").read_text()) == {"processes": 2, "sum": 2.0}


def test_the_launchers_refuse_to_fork_once_cuda_is_in_use(monkeypatch):
    from lowbit import debug_launcher

    from lowbit.kernel.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="CUDA is already in use"):
        debug_launcher(print, num_processes=2)


# ---------------------------------------------------------------------- smaller


@pytest.mark.parametrize(
    "name, row",
    [
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("Tesla T4", None),
    ],
)
def test_gpu_names_match_their_own_row_of_the_table(name, row):
    from lowbit.runtime.observe.gpu_specs import gpu_peak

    found = gpu_peak(name)
    assert (found.name if found else None) == row


def test_cuda_rng_states_are_restored_on_a_rank_that_sees_fewer_gpus(monkeypatch):
    """Saved by a process that saw 2 GPUs, restored where it sees 1 (CUDA_VISIBLE_DEVICES per rank):
    the visible GPU takes the first state (torch's set_rng_state_all failed on the missing device)."""
    from lowbit.runtime.checkpoint.training_state import set_rng_state

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]), device)))
    state = {
        "python": __import__("random").getstate(),
        "torch": torch.get_rng_state(),
        "cuda": [torch.tensor([7], dtype=torch.uint8), torch.tensor([9], dtype=torch.uint8)],
    }
    set_rng_state(state)
    assert restored == [(7, 0)]  # Accelerate's save (no own GPU's state): the first state


def test_a_rank_that_sees_other_gpus_now_gets_its_own_gpus_saved_rng_state(monkeypatch):
    """Rank 1 saved on a machine showing 2 GPUs (its own: GPU 1, state 9); resumed with only its GPU
    visible, it took GPU 0's state (7), rank 0's stream. lowbit's save also keeps the own GPU's."""
    from lowbit.runtime.checkpoint.training_state import set_rng_state

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]), device)))
    state = {
        "python": __import__("random").getstate(),
        "torch": torch.get_rng_state(),
        "cuda": [torch.tensor([7], dtype=torch.uint8), torch.tensor([9], dtype=torch.uint8)],
        "cuda_own": torch.tensor([9], dtype=torch.uint8),
    }
    set_rng_state(state)
    assert restored == [(9, 0)]
    restored.clear()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the same view as at the save: by position
    set_rng_state(state)
    assert restored == [(7, 0), (9, 1)]


@pytest.mark.parametrize("capability, slow", [((7, 5), True), ((7, 0), True), ((8, 0), False), ((9, 0), False)])
def test_bf16_on_a_gpu_without_bf16_tensor_cores_is_said_to_be_slow(monkeypatch, capability, slow):
    from lowbit.runtime.precision import Precision

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    for name in ("bf16", "fp8"):
        reason = Precision.for_run(name, torch.device("cuda", 0), False).slow_reason()
        assert bool(reason) == slow and (not slow or "no bf16 tensor cores" in reason)
    assert Precision.for_run("no", torch.device("cuda", 0), False).slow_reason() is None


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", [(), ("--use_fsdp",)], ids=["ddp", "fsdp2"])
def test_ddp_and_fsdp2_train_from_a_shuffled_loader_in_workers(shared, flags):
    """The gpu tests' scenario (test_multi_gpu_rules_gpu.py runs it on one GPU over NCCL), here on
    two CPU processes under the simulated rule."""
    ranks = shared("train", *flags)
    for rank in ranks:
        assert rank["strategy"] == ("fsdp" if flags else "ddp") and len(rank["loader_pids"]) == 8  # 2 per epoch
        assert rank["pid"] not in rank["loader_pids"]
        assert sum(rank["losses"][-4:]) < 0.5 * sum(rank["losses"][:4]), rank["losses"]
    assert ranks[0]["losses"] == ranks[1]["losses"], "gathered losses agree"


@pytest.mark.multiprocess
def test_the_hop_scenario_runs_over_gloo(shared):
    """gloo serves the CPU: the hop leaves a generator's state where it is, and gloo takes a host tensor."""
    ranks = shared("hop")
    for rank in ranks:
        assert rank["backend"] == "gloo" and rank["hop_device"] == "cpu" and rank["back_equal"]
        assert rank["host_tensor_taken"] is True


def test_a_config_files_gpu_ids_choose_the_gpus(tmp_path, monkeypatch):
    """`gpu_ids: 0,1` in a config file written by `accelerate config` (was: noted and ignored)."""
    config = tmp_path / "default_config.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\ngpu_ids: 0,1\nmixed_precision: bf16\n"
    )
    command, env, _ = launch_command(tmp_path, monkeypatch, "--config_file", str(config))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and command[command.index("--nproc_per_node") + 1] == "2"
    config.write_text("distributed_type: MULTI_GPU\ngpu_ids: all\nnum_processes: 3\n")
    command, env, _ = launch_command(tmp_path, monkeypatch, "--config_file", str(config))
    assert "CUDA_VISIBLE_DEVICES" not in env and command[command.index("--nproc_per_node") + 1] == "3"
