"""What a cluster tells ``lowbit launch`` about the job it belongs to.

A launcher started by a scheduler is one of several: Slurm's ``srun`` starts one per node, a
Kubeflow TrainJob one per pod. Each must know how many machines the job has, which one it runs on
and where machine 0 listens, or every machine trains alone and writes the same output folder.
lowbit reads what the schedulers write, the way torchrun reads its ``PET_*`` variables and
Lightning reads Slurm's, and puts it *below* the user's flags, ``LOWBIT_*`` variables and config
file. Where the settings and the cluster disagree on the number of machines, the launch stops
before any process starts: never a job silently split into independent ones.

Sources, first found wins:

- torchrun's own variables (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ...), which
  Kubeflow Trainer and PyTorchJob set in each pod;
- SkyPilot's task variables (``SKYPILOT_NUM_NODES``, ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``),
  set on every node it runs the task's ``run`` section on;
- a Slurm job step (``srun``: ``SLURM_STEP_NUM_NODES``, ``SLURM_NODEID``, the node list); in the
  batch script itself, outside ``srun``, only one launcher runs however many nodes were given;
- ``WORLD_SIZE`` exported by an outer launcher, which says there are several processes but not
  how the machines are laid out.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

from lowbit.kernel.errors import ConfigError

# torchrun reads these for its own flags (torch/distributed/run.py, the ``env`` action).
PET_PREFIX = "PET_"
# A port every node of a Slurm job computes alike from the job id, below Linux's ephemeral range
# (32768 and up), where a listening socket of another program is less likely.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 12000, 16000


@dataclasses.dataclass(frozen=True)
class ClusterJob:
    """One launcher's view of the job, as its scheduler describes it."""

    scheduler: str  # who said it, for messages: "Slurm", "torchrun's PET_* variables (Kubeflow, ...)"
    evidence: dict[str, str]  # the variables read, by name
    # Raw lowbit settings (num_machines, machine_rank, main_process_ip, main_process_port,
    # rdzv_backend): the lowest layer of the launcher's settings.
    settings: dict[str, Any]
    processes_per_machine: int | None = None
    # Why these facts cannot make one job by themselves (srun started more launchers than nodes,
    # the batch step runs one launcher on a multi-node allocation, WORLD_SIZE without a layout):
    # unless the user gives the machine count, the launch stops with it.
    problem: str = ""
    # Nodes given to the job when this launcher runs on one of them only (the batch step).
    allocated_nodes: int | None = None
    # WORLD_SIZE from an outer launcher: several launchers run, so one machine would split the job.
    one_machine_splits: bool = False

    @property
    def machines(self) -> int | None:
        return self.settings.get("num_machines")

    def shown(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.evidence.items())


def read_cluster_job(environ: Mapping[str, str] | None = None) -> ClusterJob | None:
    """The job this launcher belongs to, when a scheduler says it spans several machines (or
    several processes whose layout is unknown); None on one machine."""
    environ = os.environ if environ is None else environ
    _refuse_nested_launch(environ)
    for reader in (_from_torchrun_variables, _from_skypilot, _from_slurm, _from_world_size):
        job = reader(environ)
        if job is not None:
            return job
    return None


def check_one_job(job: ClusterJob | None, num_machines: int, machines_given_by: str | None) -> None:
    """Stop a launch that would split the cluster's job: the settings' machine count (given by
    ``machines_given_by``, None when nobody gave it) against what the scheduler says."""
    if job is None:
        return
    if machines_given_by is None:
        if job.problem:
            raise ConfigError(job.problem)
        return  # the job's own settings fill the launch in
    if job.one_machine_splits and num_machines == 1:
        raise ConfigError(job.problem)
    if job.machines is not None and job.machines > 1 and num_machines != job.machines:
        raise ConfigError(
            f"{job.scheduler} runs this launcher as one machine of {job.machines} ({job.shown()}), but "
            f"{machines_given_by} says num_machines={num_machines}: "
            + (
                f"each of the {job.machines} machines would train alone, writing the same output folder. "
                if num_machines == 1
                else "the rendezvous would wait for machines that never come. "
            )
            + f"Drop num_machines to take the cluster's {job.machines}, or set it to {job.machines}; to run "
            "independent single-machine jobs on purpose, start each as its own one-node job."
        )


def only_this_machine_note(job: ClusterJob | None, num_machines: int) -> str | None:
    """What to say when the allocation has several nodes and the user chose to train on one."""
    if job is not None and job.allocated_nodes and num_machines == 1:
        return f"{job.scheduler} gave this job {job.allocated_nodes} nodes ({job.shown()}); training on this node only."
    return None


# ------------------------------------------------------------------ the readers


def _refuse_nested_launch(environ: Mapping[str, str]) -> None:
    if environ.get("TORCHELASTIC_RUN_ID") and environ.get("LOCAL_RANK") is not None:
        raise ConfigError(
            f"lowbit launch is running inside a worker of another torchrun (TORCHELASTIC_RUN_ID="
            f"{environ['TORCHELASTIC_RUN_ID']}, LOCAL_RANK={environ['LOCAL_RANK']}): every rank would start a job "
            "of its own. Start the script with one launcher: `lowbit launch ... train.py` alone, or `torchrun ... "
            "train.py` (lowbit reads torchrun's variables in the script)."
        )


def _from_torchrun_variables(environ: Mapping[str, str]) -> ClusterJob | None:
    nodes_text = environ.get("PET_NNODES", "").strip()
    if not nodes_text:
        return None
    evidence = {name: environ[name] for name in sorted(environ) if name.startswith(PET_PREFIX) and environ[name]}
    low, _, high = nodes_text.partition(":")
    if high and high != low:
        raise ConfigError(
            f"PET_NNODES={nodes_text} asks for an elastic job (between {low} and {high} machines); lowbit launch "
            "starts a job of a fixed size. Set PET_NNODES to one number, or give --num_machines."
        )
    settings: dict[str, Any] = {"num_machines": _whole(low, "PET_NNODES")}
    if settings["num_machines"] == 1:
        return None
    if environ.get("PET_NODE_RANK"):
        settings["machine_rank"] = _whole(environ["PET_NODE_RANK"], "PET_NODE_RANK")
    backend = environ.get("PET_RDZV_BACKEND", "").strip()
    if backend:
        settings["rdzv_backend"] = backend
    endpoint = environ.get("PET_RDZV_ENDPOINT", "").strip()
    if endpoint and backend and backend != "static":
        host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
        settings["main_process_ip"] = host
        if port:
            settings["main_process_port"] = _port(port, "PET_RDZV_ENDPOINT's port")
    else:
        if environ.get("PET_MASTER_ADDR"):
            settings["main_process_ip"] = environ["PET_MASTER_ADDR"]
        if environ.get("PET_MASTER_PORT"):
            settings["main_process_port"] = _port(environ["PET_MASTER_PORT"], "PET_MASTER_PORT")
    per_machine = _processes_per_machine(environ.get("PET_NPROC_PER_NODE", "").strip())
    _rank_within(settings, "PET_NODE_RANK", "PET_NNODES")
    return ClusterJob("torchrun's PET_* variables (Kubeflow, ...)", evidence, settings, per_machine)


def _from_skypilot(environ: Mapping[str, str]) -> ClusterJob | None:
    nodes_text = environ.get("SKYPILOT_NUM_NODES", "").strip()
    if not nodes_text or _whole(nodes_text, "SKYPILOT_NUM_NODES") <= 1:
        return None
    names = ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_GPUS_PER_NODE")
    evidence = {name: environ[name] for name in names if environ.get(name)}
    settings: dict[str, Any] = {"num_machines": _whole(nodes_text, "SKYPILOT_NUM_NODES")}
    if environ.get("SKYPILOT_NODE_RANK"):
        settings["machine_rank"] = _whole(environ["SKYPILOT_NODE_RANK"], "SKYPILOT_NODE_RANK")
    head = (environ.get("SKYPILOT_NODE_IPS") or "").split()
    if head:  # one address a line, the head node's first
        settings["main_process_ip"] = head[0]
    gpus = environ.get("SKYPILOT_NUM_GPUS_PER_NODE", "").strip()
    per_machine = _whole(gpus, "SKYPILOT_NUM_GPUS_PER_NODE") if gpus and gpus != "0" else None
    _rank_within(settings, "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES")
    return ClusterJob("SkyPilot", evidence, settings, per_machine)


def _processes_per_machine(text: str) -> int | None:
    """``PET_NPROC_PER_NODE`` as torchrun reads it: a number, or auto / gpu / cpu."""
    if not text:
        return None
    if text.isdigit():
        return _whole(text, "PET_NPROC_PER_NODE")
    if text not in ("auto", "gpu", "cpu"):
        raise ConfigError(f"PET_NPROC_PER_NODE={text!r} is not a number, auto, gpu or cpu (what torchrun reads).")
    import torch

    gpus = torch.cuda.device_count()
    if text == "gpu" and not gpus:
        raise ConfigError("PET_NPROC_PER_NODE=gpu asks for one process per GPU, and this machine shows no GPU.")
    return gpus if text == "gpu" or (text == "auto" and gpus) else (os.cpu_count() or 1)


def _from_slurm(environ: Mapping[str, str]) -> ClusterJob | None:
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    step_nodes = environ.get("SLURM_STEP_NUM_NODES")
    if step_nodes is None:  # the batch script or an salloc shell: this is the only launcher
        nodes_name = "SLURM_JOB_NUM_NODES" if environ.get("SLURM_JOB_NUM_NODES") else "SLURM_NNODES"
        nodes = _whole(environ.get(nodes_name) or "1", nodes_name)
        if nodes <= 1:
            return None
        evidence = {"SLURM_JOB_ID": job_id, nodes_name: str(nodes)}
        problem = (
            f"Slurm gave this job {nodes} nodes ({nodes_name}={nodes}), but lowbit launch runs outside srun, on one "
            f"node only. Start it on every node: `srun --ntasks-per-node=1 lowbit launch ...` (lowbit then reads "
            "the rest from Slurm); or give --num_machines 1 to train on this node alone."
        )
        return ClusterJob("Slurm", evidence, {}, problem=problem, allocated_nodes=nodes)
    nodes = _whole(step_nodes, "SLURM_STEP_NUM_NODES")
    tasks = _whole(environ.get("SLURM_STEP_NUM_TASKS") or str(nodes), "SLURM_STEP_NUM_TASKS")
    if nodes <= 1 and tasks > 1:  # srun --ntasks=2 on one node: two launchers, each a job of its own
        evidence = {"SLURM_JOB_ID": job_id, "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(tasks)}
        problem = (
            f"srun started {tasks} tasks on one node (SLURM_STEP_NUM_TASKS={tasks}, SLURM_STEP_NUM_NODES={nodes}): "
            f"each would start a training job of its own, {tasks} independent jobs writing one output folder. "
            "lowbit launch starts the processes of its machine itself: run one task, `srun --ntasks=1 lowbit launch "
            f"--num_processes {tasks} ...` (or --ntasks-per-node=1 across nodes)."
        )
        return ClusterJob("Slurm", evidence, {}, problem=problem, one_machine_splits=True)
    if nodes <= 1:
        return None
    node_list = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    evidence = {
        "SLURM_JOB_ID": job_id,
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_NODEID": environ.get("SLURM_NODEID", ""),
    }
    settings: dict[str, Any] = {"num_machines": nodes}
    if environ.get("SLURM_NODEID"):
        settings["machine_rank"] = _whole(environ["SLURM_NODEID"], "SLURM_NODEID")
    _rank_within(settings, "SLURM_NODEID", "SLURM_STEP_NUM_NODES")
    # Scripts that export MASTER_ADDR / MASTER_PORT (open-r1's, Lightning's users) choose them.
    address = environ.get("MASTER_ADDR") or (first_host(node_list) if node_list else "")
    if address:
        settings["main_process_ip"] = address
    port = environ.get("MASTER_PORT")
    settings["main_process_port"] = _port(port, "MASTER_PORT") if port else slurm_port(job_id)
    problem = ""
    if tasks != nodes:
        problem = (
            f"srun started {tasks} tasks on {nodes} nodes (SLURM_STEP_NUM_TASKS={tasks}, SLURM_STEP_NUM_NODES="
            f"{nodes}): lowbit launch starts the processes of its machine itself, so it needs one task per node. "
            "Run `srun --ntasks-per-node=1 lowbit launch ...`, or spell the layout out with --num_machines, "
            "--machine_rank and --main_process_ip."
        )
    return ClusterJob("Slurm", evidence, settings, problem=problem)


def _from_world_size(environ: Mapping[str, str]) -> ClusterJob | None:
    text = environ.get("WORLD_SIZE", "").strip()
    if not text.isdigit() or int(text) <= 1:
        return None
    evidence = {name: environ[name] for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR") if environ.get(name)}
    shown = ", ".join(f"{k}={v}" for k, v in evidence.items())
    problem = (
        f"{shown} is set (by an outer launcher), so this job has {text} processes, but lowbit launch was not told "
        "how they are spread over machines and would start a job of its own on each. Give --num_machines, "
        "--machine_rank and --main_process_ip (or --rdzv_backend c10d), or unset WORLD_SIZE to train on this "
        "machine alone."
    )
    return ClusterJob("an outer launcher's WORLD_SIZE", evidence, {}, problem=problem, one_machine_splits=True)


def _rank_within(settings: dict[str, Any], rank_name: str, count_name: str) -> None:
    """The machine rank a scheduler gave is one of its machines, said with the scheduler's names."""
    rank, count = settings.get("machine_rank"), settings["num_machines"]
    if rank is not None and rank >= count:
        raise ConfigError(
            f"{rank_name}={rank} is not a machine of {count} ({count_name}={count}): machine ranks run from 0 to "
            f"{count - 1}. The scheduler's variables disagree; check how the job was started."
        )


def _port(text: str, name: str) -> int:
    port = _whole(text, name)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name}={text!r} is not a port: ports run from 1 to 65535.")
    return port


def _whole(text: str, name: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number.") from None
    if value < 0:
        raise ConfigError(f"{name}={text!r} is negative.")
    return value


# ------------------------------------------------------------------ Slurm's names


def slurm_port(job_id: str) -> int:
    """The rendezvous port of a Slurm job: the same on every node, different between jobs."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN


def first_host(node_list: str) -> str:
    """The first host of a Slurm node list: ``gpu[07-09,12],cpu1`` -> ``gpu07``,
    ``rack[1-2]-n[3,5]`` -> ``rack1-n3``."""
    depth, end = 0, len(node_list)
    for index, char in enumerate(node_list):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    first = node_list[:end].strip()
    # each bracketed range contributes its first value, zero padding kept
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)
