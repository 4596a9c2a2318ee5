"""Two machines on one host: two ``lowbit launch`` processes on 127.0.0.1, started with the command
lines and variables clusters use, must make ONE job of two processes (ranks 0 and 1, an all-reduce
over both), never two jobs of one that each train alone. Ports come from a free-port helper;
every launch is bounded by a timeout and killed past it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowbit.cli.cluster import slurm_port

from tests.helpers import launch_argv

WORKER = str(Path(__file__).resolve().parents[2] / "distributed" / "cluster_worker.py")
# Variables of the machine the tests run on that would tell the launcher about another job.
CLUSTER_PREFIXES = ("LOWBIT_", "ACCELERATE_", "SLURM_", "PET_", "TORCHELASTIC_")
CLUSTER_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
BOUND_S = 900


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_PREFIXES) and k not in CLUSTER_NAMES}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOWBIT_CONFIG_FILE=os.devnull)
    return {**env, **extra}


def run_machines(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    """Start one launcher per "machine" at once and wait for all, killing every one past the bound."""
    # Each launcher in a session of its own: past the bound, its whole tree (torchrun, the ranks) is
    # killed, since a rank left alive would hold the pipes open.
    procs = [
        subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        for cmd, env in zip(commands, envs)
    ]
    deadline = time.monotonic() + BOUND_S
    done = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    kill_session(other.pid)
                out, err = proc.communicate()
                pytest.fail(f"the launchers did not finish within {BOUND_S} s (a split or hung job):\n{err[-3000:]}")
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            kill_session(proc.pid)
    return done


def kill_session(session: int) -> None:
    """SIGKILL every process of a session (lowbit launch puts torchrun in a process group of its own)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session:  # the fields after the name: state, ppid, pgrp, session
                os.kill(int(stat.parent.name), signal.SIGKILL)


def one_job_of_two(results: list[subprocess.CompletedProcess]) -> list[dict]:
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    facts = sorted(
        (json.loads(line.split(" ", 1)[1]) for r in results for line in r.stdout.splitlines() if "CLUSTER " in line),
        key=lambda fact: fact["process"],
    )
    # One job: processes 0 and 1 of 2, one per machine, and the all-reduce saw both (1 + 2).
    assert [(f["process"], f["of"], f["sum"]) for f in facts] == [(0, 2, 3.0), (1, 2, 3.0)], facts
    return facts


@pytest.mark.multiprocess
def test_accelerates_slurm_example_with_a_c10d_rendezvous_makes_one_job(tmp_path):
    """examples/slurm/submit_multinode.sh in Accelerate: no --machine_rank, the c10d rendezvous
    numbers the machines (both launchers give the same command)."""
    port = free_port()
    command = launch_argv(
        "--num_machines", "2", "--num_processes", "2", "--rdzv_backend", "c10d",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--cpu", WORKER,
    )  # fmt: skip
    envs = [clean_env(**slurm_step(node, job_id="4100")) for node in (0, 1)]
    facts = one_job_of_two(run_machines([command, command], envs, tmp_path))
    assert sorted(f["machine"] for f in facts) == [0, 1]


@pytest.mark.multiprocess
def test_open_r1s_launcher_flags_make_one_job(tmp_path):
    """open-r1's slurm/train.slurm: static ranks from SLURM_PROCID, torchrun's --rdzv_conf, --role,
    --tee, --max_restarts, over an Accelerate config file written for one machine."""
    port = free_port()
    config = tmp_path / "ddp.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmachine_rank: 0\n"
        "main_training_function: main\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 8\n"
        "rdzv_backend: static\nsame_network: true\nuse_cpu: true\n"
    )
    commands = [
        launch_argv(
            "--config_file",
            str(config),
            "--num_machines",
            "2",
            "--num_processes",
            "2",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "--machine_rank",
            str(node),
            "--rdzv_conf",
            f"rdzv_backend=c10d,rdzv_endpoint=127.0.0.1:{port}",
            "--max_restarts",
            "1",
            "--role",
            f"{socket.gethostname()}:",
            "--tee",
            "3",
            WORKER,
        )  # fmt: skip
        for node in (0, 1)
    ]
    envs = [clean_env(**slurm_step(node, job_id="4200")) for node in (0, 1)]
    facts = one_job_of_two(run_machines(commands, envs, tmp_path))
    assert [f["machine"] for f in facts] == [0, 1]


@pytest.mark.multiprocess
def test_kubeflow_pods_torchrun_variables_make_one_job(tmp_path):
    """A Kubeflow TrainJob sets PET_* in each pod for torchrun; the pod runs `lowbit launch train.py`."""
    port = free_port()
    envs = [
        clean_env(
            PET_NNODES="2",
            PET_NPROC_PER_NODE="1",
            PET_NODE_RANK=str(node),
            PET_MASTER_ADDR="127.0.0.1",
            PET_MASTER_PORT=str(port),
        )  # fmt: skip
        for node in (0, 1)
    ]
    command = launch_argv("--cpu", WORKER)
    facts = one_job_of_two(run_machines([command, command], envs, tmp_path))
    assert [f["machine"] for f in facts] == [0, 1]


@pytest.mark.multiprocess
def test_srun_without_launcher_flags_makes_one_job_from_slurms_variables(tmp_path):
    """`srun lowbit launch train.py` on two nodes: the machine count, this node's rank, machine 0's
    address (the node list's first host) and a port derived from the job id, all from Slurm."""
    job_id = next(str(j) for j in range(os.getpid(), os.getpid() + 5000) if port_is_free(slurm_port(str(j))))
    envs = [clean_env(**slurm_step(node, job_id=job_id)) for node in (0, 1)]
    command = launch_argv("--cpu", WORKER)
    results = run_machines([command, command], envs, tmp_path)
    facts = one_job_of_two(results)
    assert [f["machine"] for f in facts] == [0, 1]
    assert f"localhost:{slurm_port(job_id)}" in results[0].stderr  # the launcher says what it read


def slurm_step(node: int, job_id: str) -> dict[str, str]:
    """What srun sets for a task of a one-task-per-node step on two nodes (the first is this host)."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "localhost,gpu-b[07-08]",
        "SLURM_STEP_NODELIST": "localhost,gpu-b07",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
    }


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


RESUME = Path(__file__).resolve().parents[3] / "examples" / "cluster_resume.py"


def _losses(stdout: str) -> dict[int, str]:
    return {int(line.split()[1]): line.split()[3] for line in stdout.splitlines() if line.startswith("step ")}


@pytest.mark.multiprocess
def test_a_restarted_job_resumes_from_the_newest_checkpoint_with_the_same_losses(tmp_path):
    """examples/cluster_resume.py: a first attempt that fails at step 6 (saved at 4), started again
    as torchrun's --max_restarts or a requeue would, trains steps 5 to 12 as the unbroken run did.
    (torch 2.13's own restart of gloo processes fails to reconnect on CPU, so the second attempt is a
    second launch here; --max_restarts reaching torchrun is tested in test_cluster.py.)"""

    def launch(project: Path, *extra: str) -> subprocess.CompletedProcess:
        command = launch_argv(
            "--cpu", "--num_processes", "2", str(RESUME), "--project_dir", str(project),
            "--steps", "12", "--save_every", "4", *extra,
        )  # fmt: skip
        return subprocess.run(command, env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=BOUND_S)

    unbroken = launch(tmp_path / "unbroken")
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    crashed = launch(tmp_path / "broken", "--crash_at", "6")
    assert crashed.returncode != 0 and "--crash_at 6" in crashed.stderr
    resumed = launch(tmp_path / "broken", "--crash_at", "6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 4" in resumed.stdout
    expected = _losses(unbroken.stdout)
    assert sorted(expected) == list(range(1, 13))
    assert _losses(resumed.stdout) == {step: loss for step, loss in expected.items() if step > 4}
