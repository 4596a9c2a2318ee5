"""``lowbit fp8-payoff``: will FP8 make this model's training step faster on that GPU?"""

from __future__ import annotations

import argparse
from typing import Any

from lowbit.kernel.types import RecipeCost


def add_parser(sub: Any, name: str, help_text: str) -> None:
    from lowbit.runtime.observe.fp8_payoff import RECOMPUTE
    from lowbit.runtime.observe.gpu_specs import GPU_PEAKS

    parser = sub.add_parser(
        name,
        help=help_text,
        description=help_text
        + ". "
        + (
            "Predicts each Linear layer's time in bf16 and in the recipe (GEMMs and the casts the recipe adds) "
            "and the whole step (attention, pointwise work and the optimizer unchanged), from the model's shapes: "
            "nothing is allocated, downloaded or run. Method and validation: docs/fp8-payoff.md."
        ),
    )
    parser.add_argument(
        "model", help="a transformers config (config.json or a directory holding one), or module:factory"
    )
    parser.add_argument("--tokens", type=int, required=True, help="tokens per GPU per micro-batch (batch x sequence)")
    parser.add_argument("--gpu", required=True, help="one of: " + ", ".join(p.name for p in GPU_PEAKS if p.memory_tbps))
    parser.add_argument(
        "--recipe",
        default="tensorwise",
        help="a recipe an installed backend declares a cost for (`lowbit plugins` lists the backends; default "
        "tensorwise)",
    )
    parser.add_argument(
        "--backend", default=None, help="whose implementation of the recipe to cost (default: the first in the ranking)"
    )
    parser.add_argument("--seq_len", type=int, default=None, help="tokens per sample (default: --tokens, one sample)")
    parser.add_argument(
        "--activation_checkpointing",
        default="none",
        choices=list(RECOMPUTE),
        help="recomputed forward work: none, op (torchtitan's per-op selective), full (default none)",
    )
    parser.add_argument(
        "--shards", type=int, default=1, help="ranks the optimizer state is sharded over (default 1: not sharded)"
    )
    parser.add_argument("--eager", action="store_true", help="no torch.compile: pointwise work and casts unfused")
    parser.add_argument(
        "--keep",
        default="first_last",
        choices=["first_last", "none"],
        help="layers kept in bf16 besides those FP8 cannot take: lowbit's default (first and last Linear) or none",
    )
    parser.add_argument(
        "--auto", action="store_true", help="also keep in bf16 the layers predicted slower in FP8 (layer_filter='auto')"
    )
    parser.set_defaults(run=run)


def installed_costs(backend: str | None = None) -> dict[str, tuple[str, RecipeCost]]:
    """recipe -> (backend, its cost), from the installed backends' descriptions (``recipe_costs``),
    the first in their ranking for each recipe, or ``backend``'s alone."""
    from lowbit.run.plugin_manager import registry_for_names

    registry = registry_for_names()
    costs: dict[str, tuple[str, RecipeCost]] = {}
    for choice in registry.ranked("backend"):
        if backend is None or choice.name == backend:
            for recipe, cost in choice.description.recipe_costs.items():
                costs.setdefault(recipe, (choice.name, cost))
    return costs


def run(args: argparse.Namespace) -> int:
    from lowbit.kernel.errors import ConfigError, did_you_mean
    from lowbit.kernel.recipe_names import canonical_recipe

    from lowbit.runtime.observe.fp8_payoff import count_work, first_last, known_gpu, predict, table
    from lowbit.runtime.observe.model_spec import load_model_on_meta

    seq_len = args.seq_len or args.tokens
    if args.tokens < 1 or seq_len < 1 or args.tokens % seq_len or args.shards < 1:
        raise ConfigError(
            f"fp8-payoff: --tokens ({args.tokens}) must be a positive multiple of --seq_len ({seq_len}), "
            f"and --shards ({args.shards}) at least 1."
        )
    gpu = known_gpu(args.gpu)
    recipe = canonical_recipe(args.recipe, where="fp8-payoff --recipe")
    costs = installed_costs(args.backend)
    if recipe not in costs:
        who = f"backend {args.backend!r} declares no" if args.backend else "no installed backend declares a"
        raise ConfigError(
            f"{who} cost for recipe {recipe!r}.{did_you_mean(recipe, costs)} "
            f"Costed here: {', '.join(f'{r} ({b})' for r, (b, _) in costs.items()) or 'none'}. "
            "A backend that runs the recipe natively declares it (`pip install` its plugin)."
        )
    backend, cost = costs[recipe]
    work = count_work(load_model_on_meta(args.model), args.tokens // seq_len, seq_len)
    keep = first_last(work) if args.keep == "first_last" else {}
    prediction = predict(
        work,
        gpu,
        recipe,
        cost,
        keep,
        compiled=not args.eager,
        recompute=args.activation_checkpointing,
        shards=args.shards,
        auto=args.auto,
    )
    print(
        f"{args.model}: {work.parameters / 1e9:.2f} B parameters, {args.tokens} tokens per GPU "
        f"({args.tokens // seq_len} x {seq_len}), {gpu.name} ({gpu.source}), {recipe} as {backend} runs it "
        f"({cost.source}), "
        f"{'eager' if args.eager else 'compiled'}, activation checkpointing {args.activation_checkpointing}"
    )
    print(table(prediction))
    return 0
