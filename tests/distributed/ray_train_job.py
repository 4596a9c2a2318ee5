"""transformers' Trainer under Ray Train on a local Ray cluster of 2 CPU workers, as Ray's
Hugging Face recipe writes it (``TorchTrainer``, ``prepare_trainer``, ``RayTrainReportCallback``),
for tests/trainer/test_ray_train.py: each job a ``TorchTrainer.fit()`` of its own, in turn, on one
Ray cluster (started once: a cluster's start-up costs more than a job).

    python tests/distributed/ray_train_job.py OUT JOB[,JOB...]

Jobs: ``stock`` (stock Accelerate), ``lowbit`` (each worker first calls ``lowbit.patch_trainer()``,
the one documented line), ``fp8`` (lowbit, with ``ACCELERATE_MIXED_PRECISION=fp8`` in the cluster's
runtime_env, as docs/cluster.md writes it; the other jobs set it back to ``no`` in their workers'
runtime_env). Each worker writes ``OUT/JOB/result_<rank>.json`` (trainer_worker.write_result's figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "trainer" / "trainer_worker.py"


def train_func(config: dict) -> None:
    if config["lowbit"]:
        import lowbit

        lowbit.patch_trainer()
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    spec = importlib.util.spec_from_file_location("trainer_worker", config["worker"])
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    args = argparse.Namespace(
        out=config["out"], trainer="trainer", bf16=False, steps=10, fsdp=False, deepspeed=0, pretrained=None
    )
    run = worker.trainer(args)
    run.add_callback(RayTrainReportCallback())
    reported: list[dict] = []  # the logs the reporting integrations get (lowbit's figures among them)
    run.add_callback(worker.ReportedLogs(reported))
    run = prepare_trainer(run)
    before = {name: p.detach().float().clone() for name, p in run.model.named_parameters() if p.requires_grad}
    run.train()
    worker.write_result(run, before, Path(config["out"]), reported=reported)
    ray.train.report({"done": 1})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("jobs", help="comma-separated: stock, lowbit, fp8")
    args = parser.parse_args()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    env_vars = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    fp8 = {"ACCELERATE_MIXED_PRECISION": "fp8"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {**env_vars, **fp8}})
    for job in args.jobs.split(","):
        out = os.path.abspath(os.path.join(args.out, job))
        precision = fp8 if job == "fp8" else {"ACCELERATE_MIXED_PRECISION": "no"}
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"lowbit": job != "stock", "out": out, "worker": str(WORKER)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(
                storage_path=os.path.join(out, "ray"),
                name="job",
                worker_runtime_env={"env_vars": {**env_vars, **precision}},
            ),
        )
        trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
