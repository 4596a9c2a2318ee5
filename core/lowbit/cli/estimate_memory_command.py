"""``lowbit estimate-memory``: per-process memory of training a model, per precision and strategy."""

from __future__ import annotations

import argparse
from typing import Any

from lowbit.kernel.types import StrategyMemory


def add_parser(sub: Any, name: str, help_text: str) -> None:
    parser = sub.add_parser(
        name,
        help=help_text,
        description=help_text + ". " + ("The model is built on the meta device: nothing is allocated or downloaded."),
    )
    parser.add_argument(
        "model", help="a transformers config (config.json or a directory holding one), or module:factory"
    )
    parser.add_argument(
        "--precisions", default="no,bf16,fp8", help="comma-separated: no, fp16, bf16, fp8, fp4 (default: no,bf16,fp8)"
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated names the installed strategies declare (default: all of them; "
        "`lowbit plugins` lists the strategies)",
    )
    parser.add_argument("--num_processes", type=int, default=2, help="ranks the strategies shard over (default 2)")
    parser.add_argument("--batch_size", type=int, default=8, help="per-process micro-batch (default 8)")
    parser.add_argument(
        "--seq_len", type=int, default=512, help="tokens per sample for a transformers model (default 512)"
    )
    parser.set_defaults(run=run)


def backend_memory() -> dict[str, dict[str, float]]:
    """What each installed low-precision backend declares about its bytes per parameter."""
    from lowbit.run.plugin_manager import registry_for_names

    return {c.name: dict(c.description.memory_per_parameter) for c in registry_for_names().ranked("backend")}


def strategy_memory(asked: str | None) -> dict[str, StrategyMemory]:
    """The memory layouts the installed strategies declare, by name, the ones ``asked`` for (all when None)."""
    from lowbit.kernel.errors import ConfigError, did_you_mean

    from lowbit.run.plugin_manager import registry_for_names

    declared = {
        name: memory for c in registry_for_names().ranked("strategy") for name, memory in c.description.memory.items()
    }
    names = list(declared) if asked is None else [s.strip() for s in asked.split(",") if s.strip()]
    for name in names:
        if name not in declared:
            raise ConfigError(
                f"estimate-memory: unknown strategy {name!r}.{did_you_mean(name, declared)} The installed "
                f"strategies declare: {', '.join(declared)} (a strategy whose plugin is not installed declares none)."
            )
    return {name: declared[name] for name in names}


def run(args: argparse.Namespace) -> int:
    from lowbit.kernel.errors import ConfigError

    from lowbit.runtime.observe.memory_estimate import estimate_all, table

    if args.num_processes < 1 or args.batch_size < 1 or args.seq_len < 1:
        raise ConfigError("estimate-memory: --num_processes, --batch_size and --seq_len must be at least 1.")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    strategies = strategy_memory(args.strategies)
    estimates = estimate_all(
        args.model, precisions, strategies, args.num_processes, args.batch_size, args.seq_len, backend_memory()
    )
    params = estimates[0].parameters if estimates else 0
    print(
        f"{args.model}: {params / 1e6:.2f} M parameters; per process, {args.num_processes} process(es), micro-batch "
        f"{args.batch_size} x {args.seq_len}; AdamW; MB = 2^20 bytes"
    )
    print(table(estimates))
    print(
        "peak = weights + optimizer states + buffers + max(activations, gradients + one parameter-sized step "
        "temporary). "
        "A backend's bytes per parameter are what it declares; measured against real runs: see each strategy's note "
        "(tests/core/observe/test_estimate_memory.py)."
    )
    for name, memory in strategies.items():
        print(f"  {name}: {memory.note or 'not measured'}")
    return 0
