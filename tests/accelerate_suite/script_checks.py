"""The checks of Accelerate's launched test scripts (``test_utils/scripts/test_script.py``,
``test_sync.py``, ``test_ops.py``), run one by one in each process of a 2-process launch, under
Accelerate or lowbit (the scripts' imports rewritten for lowbit by run_suite.py).

    torchrun --nproc_per_node 2 script_checks.py --library accelerate --scripts DIR --script test_ops \\
        --from_check 0 --out OUT
    lowbit launch --cpu --num_processes 2 script_checks.py --library lowbit ...

Each check is called as the script's ``main()`` calls it on 2 CPU processes (MULTI_CPU). After each
one this process appends its outcome to OUT/<script>_rank<N>.json; a failing check ends the
launch (the processes may be out of step in their collectives after it), and run_suite.py starts a
new one at the next check.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
from pathlib import Path

# script -> its checks in the order main() calls them on 2 CPU processes: (function, argument),
# the argument one of None (no argument), "state" (PartialState()), "accelerator" (the Accelerator
# main() makes), "datasets" (datasets.Dataset, when installed) or a dict of keyword arguments.
CHECKS: dict[str, list[tuple[str, object]]] = {
    "test_ops": [
        (name, "state")
        for name in (
            "test_gather",
            "test_gather_object",
            "test_gather_non_contiguous",
            "test_broadcast",
            "test_pad_across_processes",
            "test_reduce_sum",
            "test_reduce_mean",
            "test_reduce_max",
            "test_op_checker",
            "test_copy_tensor_to_devices",
        )
    ],
    "test_script": [
        ("init_state_check", None),
        ("process_execution_check", None),
        ("test_split_between_processes_list", None),
        ("test_split_between_processes_nested_dict", None),
        ("test_split_between_processes_tensor", None),
        ("test_split_between_processes_evenly", None),
        ("test_split_between_processes_dataset", "datasets"),
        ("rng_sync_check", None),
        ("dl_preparation_check", None),
        ("central_dl_preparation_check", None),
        ("custom_sampler_check", None),
        ("check_seedable_sampler", None),
        ("check_seedable_sampler_with_data_seed", None),
        ("check_seedable_sampler_in_batch_sampler_shard", None),
        ("training_check", {"use_seedable_sampler": False}),
        ("training_check", {"use_seedable_sampler": True}),
        ("test_trigger", None),
        ("test_reinstantiated_state", None),
    ],
    "test_sync": [
        ("test_dataloader_break", None),
        ("test_distributed_sync", "accelerator"),
        ("test_distributed_sync_multiple_fwd", "accelerator"),
        ("test_gradient_accumulation_with_opt_and_scheduler", None),
    ],
}


IMPORT_FAILED = "<import>"  # the key a script that does not import is recorded under


def check_id(name: str, argument: object) -> str:
    if isinstance(argument, dict):
        return f"{name}[{','.join(f'{k}={v}' for k, v in argument.items())}]"
    return name


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=("accelerate", "lowbit"), required=True)
    parser.add_argument("--scripts", required=True, help="folder with the (rewritten) scripts")
    parser.add_argument("--script", choices=sorted(CHECKS), required=True)
    parser.add_argument("--from_check", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch.distributed as dist

    # A short timeout: after a failing check the processes may wait in different collectives.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    sys.path.insert(0, args.scripts)
    lib = importlib.import_module(args.library)
    record = Path(args.out) / f"{args.script}_rank{dist.get_rank()}.json"
    outcomes = json.loads(record.read_text()) if record.exists() else {}
    try:
        script = importlib.import_module(args.script)
    except Exception as error:  # noqa: BLE001 - every check fails with it
        outcomes[IMPORT_FAILED] = f"failed: the script does not import: {type(error).__name__}: {str(error)[:300]}"
        record.write_text(json.dumps(outcomes))
        return 3
    # main() makes its Accelerator (or, in test_ops, its PartialState) before the first check.
    accelerator = lib.Accelerator() if args.script != "test_ops" else None
    for name, argument in CHECKS[args.script][args.from_check :]:
        check = getattr(script, name)
        if argument == "datasets":
            try:
                from datasets import Dataset
            except ImportError:
                outcomes[check_id(name, argument)] = "skipped: datasets is not installed"
                continue
            call = lambda: check(Dataset)  # noqa: E731
        elif argument == "state":
            call = lambda: check(lib.PartialState())  # noqa: E731
        elif argument == "accelerator":
            call = lambda: check(accelerator)  # noqa: E731
        elif isinstance(argument, dict):
            call = lambda: check(**argument)  # noqa: E731
        else:
            call = check
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - any failure of the check is its outcome
            outcomes[check_id(name, argument)] = f"failed: {type(error).__name__}: {str(error)[:300]}"
            record.write_text(json.dumps(outcomes))
            return 3
        outcomes[check_id(name, argument)] = "passed"
        record.write_text(json.dumps(outcomes))
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
