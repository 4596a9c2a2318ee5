"""What lowbit launch reads from a cluster, and the launches it refuses before any process starts
(a job that would be split into independent single-machine ones, or hang)."""

from __future__ import annotations

import os
import sys

import pytest

from lowbit.cli.cluster import first_host, read_cluster_job, slurm_port

from lowbit.kernel.errors import ConfigError

from tests.core.cli.test_cluster_launch import slurm_step


def build(tmp_path, monkeypatch, env: dict[str, str], *flags: str):
    """lowbit launch's command for ``flags`` under ``env`` (the machine's own cluster variables removed)."""
    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    for name in list(os.environ):
        if name.startswith(("SLURM_", "PET_", "TORCHELASTIC_")) or name in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOWBIT_CONFIG_FILE", os.devnull)
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    return build_command(build_parser().parse_args(["launch", *flags, str(script)]))


def after(command: list[str], option: str) -> str:
    return command[command.index(option) + 1]


@pytest.mark.parametrize(
    "node_list, first",
    [
        ("gpu-a17", "gpu-a17"),
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("n[3,5-6]", "n3"),
        ("rack[1-2]-n[004-010]", "rack1-n004"),
        ("a,b[1-2]", "a"),
    ],
)
def test_the_first_host_of_a_slurm_node_list(node_list, first):
    assert first_host(node_list) == first


def test_slurms_port_is_the_same_on_every_node_and_differs_between_jobs():
    assert slurm_port("123456") == slurm_port("123456")
    assert slurm_port("123456") != slurm_port("123457")
    assert all(12000 <= slurm_port(str(job)) < 28000 for job in range(0, 100000, 997))


def test_an_srun_task_is_machine_nodeid_of_the_steps_nodes(tmp_path, monkeypatch, capsys):
    command, env, config = build(tmp_path, monkeypatch, slurm_step(1, job_id="77"), "--cpu")
    assert (config.num_machines, config.machine_rank, config.num_processes) == (2, 1, 2)
    assert after(command, "--node_rank") == "1" and after(command, "--master_addr") == "localhost"
    assert after(command, "--master_port") == str(slurm_port("77"))
    assert "Slurm: machine 1 of 2" in capsys.readouterr().err


def test_a_script_that_exports_master_addr_and_port_chooses_them(tmp_path, monkeypatch):
    env = {**slurm_step(1, job_id="77"), "MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "6000"}
    command, _, _ = build(tmp_path, monkeypatch, env, "--cpu")
    assert (after(command, "--master_addr"), after(command, "--master_port")) == ("10.9.8.7", "6000")


def test_num_machines_one_under_a_two_node_srun_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="each of the 2 machines would train alone") as error:
        build(tmp_path, monkeypatch, slurm_step(0, job_id="5"), "--cpu", "--num_machines", "1")
    assert "SLURM_STEP_NUM_NODES=2" in str(error.value) and "--num_machines" in str(error.value)


def test_num_machines_one_in_the_config_file_under_kubeflow_is_refused(tmp_path, monkeypatch):
    """Accelerate's config files say num_machines: 1; with a TrainJob's PET_NNODES=2 that splits the job."""
    config = tmp_path / "acc.yaml"
    config.write_text("num_machines: 1\nnum_processes: 1\nuse_cpu: true\n")
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "29999"}
    with pytest.raises(ConfigError, match="would train alone") as error:
        build(tmp_path, monkeypatch, env, "--config_file", str(config))
    assert "PET_NNODES=2" in str(error.value) and "acc.yaml" in str(error.value)


def test_more_machines_than_the_cluster_has_would_hang_and_is_refused(tmp_path, monkeypatch):
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1"}
    with pytest.raises(ConfigError, match="never come"):
        build(tmp_path, monkeypatch, env, "--cpu", "--num_machines", "4", "--num_processes", "4")


def test_the_flags_win_over_the_torchrun_variables(tmp_path, monkeypatch):
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "10.0.0.1", "PET_NPROC_PER_NODE": "4"}
    command, _, config = build(tmp_path, monkeypatch, env, "--cpu", "--machine_rank", "1", "--num_processes", "2")
    assert after(command, "--node_rank") == "1" and after(command, "--nproc_per_node") == "1"
    assert after(command, "--master_addr") == "10.0.0.1"


def test_pet_nproc_per_node_sets_the_processes_of_each_machine(tmp_path, monkeypatch):
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.0.0.1", "PET_NPROC_PER_NODE": "3"}
    command, _, config = build(tmp_path, monkeypatch, env, "--cpu")
    assert config.num_processes == 6 and after(command, "--nproc_per_node") == "3"
    env["PET_NPROC_PER_NODE"] = "cpu"  # torchrun's word: one process per core
    command, _, _ = build(tmp_path, monkeypatch, env, "--cpu")
    assert after(command, "--nproc_per_node") == str(os.cpu_count())


def test_a_c10d_rendezvous_from_kubeflows_elastic_variables(tmp_path, monkeypatch):
    env = {"PET_NNODES": "2", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "trainer-node-0:29400"}
    command, _, _ = build(tmp_path, monkeypatch, env, "--cpu")
    assert after(command, "--rdzv_backend") == "c10d" and after(command, "--rdzv_endpoint") == "trainer-node-0:29400"
    assert "--node_rank" not in command


def test_an_elastic_range_of_machines_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="elastic"):
        build(tmp_path, monkeypatch, {"PET_NNODES": "1:4"}, "--cpu")


def test_the_batch_script_of_a_two_node_job_is_stopped_with_how_to_use_srun(tmp_path, monkeypatch, recwarn):
    env = {"SLURM_JOB_ID": "9", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0"}
    with pytest.raises(ConfigError, match="outside srun") as error:
        build(tmp_path, monkeypatch, env, "--cpu")
    assert "srun --ntasks-per-node=1 lowbit launch" in str(error.value)
    _, _, config = build(tmp_path, monkeypatch, env, "--cpu", "--num_machines", "1")  # on purpose: a note
    assert config.num_machines == 1 and "training on this node only" in " ".join(str(w.message) for w in recwarn)


def test_srun_with_several_tasks_per_node_is_refused(tmp_path, monkeypatch):
    env = {**slurm_step(0, job_id="3"), "SLURM_STEP_NUM_TASKS": "16"}
    with pytest.raises(ConfigError, match="one task per node"):
        build(tmp_path, monkeypatch, env, "--cpu")


def test_world_size_from_an_outer_launcher_needs_the_layout(tmp_path, monkeypatch):
    env = {"WORLD_SIZE": "4", "RANK": "2", "MASTER_ADDR": "10.0.0.1"}
    with pytest.raises(ConfigError, match="WORLD_SIZE=4") as error:
        build(tmp_path, monkeypatch, env, "--cpu")
    assert "--num_machines" in str(error.value)
    command, _, _ = build(
        tmp_path, monkeypatch, env, "--cpu", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "h0"
    )
    assert after(command, "--nnodes") == "2"


def test_lowbit_launch_inside_a_torchrun_worker_is_refused():
    with pytest.raises(ConfigError, match="inside a worker of another torchrun"):
        read_cluster_job({"TORCHELASTIC_RUN_ID": "abc", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})


def test_one_machine_reads_no_cluster():
    assert read_cluster_job({}) is None
    assert read_cluster_job({"SLURM_JOB_ID": "1", "SLURM_NNODES": "1"}) is None
    assert read_cluster_job({"PET_NNODES": "1"}) is None and read_cluster_job({"WORLD_SIZE": "1"}) is None


# ------------------------------------------------------------------ the launcher flags a cluster passes


def test_a_c10d_rendezvous_passes_the_endpoint_and_no_machine_rank(tmp_path, monkeypatch):
    command, _, _ = build(
        tmp_path, monkeypatch, {}, "--cpu", "--num_machines", "2", "--num_processes", "16",
        "--rdzv_backend", "c10d", "--main_process_ip", "head", "--main_process_port", "29500",
    )  # fmt: skip
    assert after(command, "--rdzv_backend") == "c10d" and after(command, "--rdzv_endpoint") == "head:29500"
    assert "--node_rank" not in command and after(command, "--nproc_per_node") == "8"


def test_the_config_files_rdzv_backend_is_honoured(tmp_path, monkeypatch):
    config = tmp_path / "acc.yaml"
    config.write_text("rdzv_backend: c10d\nnum_machines: 2\nnum_processes: 2\nmain_process_ip: head\nuse_cpu: true\n")
    command, _, _ = build(tmp_path, monkeypatch, {}, "--config_file", str(config))
    assert after(command, "--rdzv_backend") == "c10d"


def test_torchruns_flags_reach_torchrun(tmp_path, monkeypatch):
    command, _, _ = build(
        tmp_path, monkeypatch, {}, "--cpu", "--num-processes", "2", "--rdzv_conf", "join_timeout=900",
        "--role", "node7:", "--tee", "3", "--log_dir", str(tmp_path / "logs"), "--max_restarts", "2",
        "--monitor_interval", "1",
    )  # fmt: skip
    for option in (
        "--rdzv_conf=join_timeout=900",
        "--role=node7:",
        "--tee=3",
        f"--log_dir={tmp_path / 'logs'}",
        "--max_restarts=2",
        "--monitor_interval=1.0",
    ):
        assert option in command
    assert command.index("--max_restarts=2") < command.index("lowbit.cli.run_script")  # torchrun's, not the script's


def test_no_python_runs_the_program_itself(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "train.py").chmod(0o755)  # a program: --no_python refuses a script that is not executable
    command, _, _ = build(tmp_path, monkeypatch, {}, "--cpu", "--num_processes", "2", "--no_python")
    assert "--no_python" in command and "lowbit.cli.run_script" not in command and command[-1].endswith("train.py")
    command, _, _ = build(tmp_path, monkeypatch, {}, "--cpu", "--no_python")
    assert command == [str(tmp_path / "train.py")]


def test_deepspeeds_one_command_launchers_are_refused_and_standard_is_lowbits(tmp_path, monkeypatch):
    flags = ("--cpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "head")
    with pytest.raises(ConfigError, match="pdsh starts every machine from one command"):
        build(tmp_path, monkeypatch, {}, *flags, "--machine_rank", "1", "--deepspeed_multinode_launcher", "pdsh")
    command, _, _ = build(
        tmp_path, monkeypatch, {}, *flags, "--machine_rank", "1", "--deepspeed_multinode_launcher", "standard",
        "--deepspeed_hostfile", "/etc/hosts",
    )  # fmt: skip
    assert after(command, "--node_rank") == "1"


def test_a_machine_rank_outside_the_job_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not a machine of 2"):
        build(
            tmp_path, monkeypatch, {}, "--cpu", "--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "h"
        )


def test_skypilots_task_variables_make_one_job(tmp_path, monkeypatch):
    env = {
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NODE_IPS": "10.1.0.4\n10.1.0.5",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    }
    command, _, config = build(tmp_path, monkeypatch, env)
    assert (config.num_machines, config.machine_rank, config.num_processes) == (2, 1, 16)
    assert after(command, "--master_addr") == "10.1.0.4" and after(command, "--nproc_per_node") == "8"


def test_srun_with_two_tasks_on_one_node_is_refused_not_split(tmp_path, monkeypatch):
    """``srun --ntasks=2`` on one node started two launchers, each a one-process job writing the same
    folder: refused, with or without --num_machines 1, saying how to run it."""
    env = {
        "SLURM_JOB_ID": "9",
        "SLURM_NNODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "1",
        "SLURM_STEP_NODELIST": "localhost",
    }
    for flags in ((), ("--num_machines", "1")):
        with pytest.raises(ConfigError, match=r"srun started 2 tasks on one node .* --num_processes 2"):
            build(tmp_path, monkeypatch, env, "--cpu", *flags)


@pytest.mark.parametrize(
    "env, said",
    [
        (
            {"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "h"},
            r"PET_NODE_RANK=2 is not a machine of 2 \(PET_NNODES=2\)",
        ),
        ({"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "5"}, r"SKYPILOT_NODE_RANK=5 is not a machine of 2"),
        (
            {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_PORT": "70000"},
            r"PET_MASTER_PORT='70000' is not a port",
        ),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_PORT": "-1"}, r"PET_MASTER_PORT='-1' is negative"),
        ({**slurm_step(0, job_id="3"), "MASTER_PORT": "99999"}, r"MASTER_PORT='99999' is not a port"),
    ],
)
def test_a_bad_scheduler_value_is_named_by_the_variable_that_was_read(tmp_path, monkeypatch, env, said):
    with pytest.raises(ConfigError, match=said) as error:
        build(tmp_path, monkeypatch, env, "--cpu")
    assert "--machine_rank" not in str(error.value) and "--main_process_port" not in str(error.value)


@pytest.mark.parametrize(
    "flags, said",
    [
        (("--num_processes", "2", "--monitor_interval", "-1"), r"--monitor_interval -1: it takes a number more than 0"),
        (("--num_processes", "2", "--max_restarts", "-3"), r"--max_restarts -3: it takes a number at least 0"),
        (("--no_python",), r"--no_python runs .*train.py' as a program, and it is not executable"),
    ],
)
def test_launcher_values_torchrun_or_the_system_would_fail_on_are_errors(tmp_path, monkeypatch, flags, said):
    with pytest.raises(ConfigError, match=said):
        build(tmp_path, monkeypatch, {}, "--cpu", *flags)


def test_a_c10d_endpoint_whose_port_another_program_holds_is_an_error_not_a_wait(tmp_path, monkeypatch):
    """Only the static rendezvous checked its port: with c10d a busy port hung the launch for 150 s
    and more. Held by a rendezvous store (another launcher of the job on this machine), it is fine."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        flags = ("--num_machines", "2", "--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1")
        with pytest.raises(ConfigError, match=rf"--main_process_port {port} on 127.0.0.1 .* held by another program"):
            build(tmp_path, monkeypatch, {}, "--cpu", *flags, "--main_process_port", str(port))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    command, _, _ = build(tmp_path, monkeypatch, {}, "--cpu", *flags, "--main_process_port", str(store.port))
    assert f"127.0.0.1:{store.port}" in command
