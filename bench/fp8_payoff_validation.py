"""The FP8 payoff prediction against published figures: calibration, validation, and the
automatic layer filter beside torchao's.

    python bench/fp8_payoff_validation.py

Calibration (the prediction's constants were set from these): torchao's published H100
microbenchmark of one tensorwise Linear, forward and backward, compiled. Validation (never used
to set anything): end-to-end Llama-3-8B training on 8 GPUs, sequence 8192, batch 1, compile,
FSDP2, per-op selective activation checkpointing, from torchao's and torchtitan's docs.
Needs transformers (the model is built from examples/models/llama3-8b.json on the meta device).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_8B = ROOT / "examples" / "models" / "llama3-8b.json"
TOLERANCE = 0.10

# (M, K, N), published speedup of a tensorwise Linear fwd+bwd over bf16 on an H100 (torchao
# torchao/float8/README.md, "Performance", examples 1 and 2; benchmarks/float8/float8_roofline.py).
CALIBRATION = [((4096, 8192, 16384), 1.39, "fit: sets FP8_GEMM_SHARE"), ((1024, 2048, 1024), 0.80, "check only")]
# The H100 torchao's microbenchmarks ran on: 2.4 TB/s (benchmarks/float8/utils/roofline_utils.py).
CALIBRATION_MEMORY_TBPS = 2.4

# (GPU, recipe, published step speedup over bf16, source). All: Llama-3-8B, 8 GPUs, sequence
# 8192, batch 1, torch.compile, FSDP2, per-op SAC.
VALIDATION = [
    ("H100", "tensorwise", 1.2503, "torchao/float8/README.md: 6150 -> 7689.5 tokens/s (float8 all-gather)"),
    ("H100", "rowwise", 1.1005, "torchao/float8/README.md: 6150 -> 6768 tokens/s"),
    ("B200", "tensorwise", 1.254, "torchao's B200 figures as quoted in lowbit issue #37: +25.4%"),
    ("B200", "rowwise", 1.040, "torchao's B200 figures as quoted in lowbit issue #37: +4.0%"),
    ("B200", "mxfp8", 1.200, "torchao's B200 figures as quoted in lowbit issue #37: +20.0%"),
    ("MI300X", "tensorwise", 1.1468, "torchao/float8/README.md: 5376.5 -> 6166.0 tokens/s (float8 all-gather)"),
    ("MI300X", "rowwise", 1.0957, "torchao/float8/README.md: 5376.5 -> 5891.0 tokens/s"),
    ("MI300X", "rowwise_with_gw_hp", 1.1346, "torchao/float8/README.md: 5376.5 -> 6100.0 tokens/s"),
]
REQUIRED = {("H100", "tensorwise"), ("H100", "rowwise"), ("B200", "mxfp8")}  # issue #37's "done when"


def llama3_8b_work():
    from lowbit.runtime.observe.fp8_payoff import count_work
    from lowbit.runtime.observe.model_spec import load_model_on_meta

    return count_work(load_model_on_meta(str(LLAMA3_8B)), 1, 8192)


def torchao_cost(recipe: str):
    """lowbit-ao's cost of ``recipe``: every published figure here was measured with torchao."""
    from lowbit_ao.costs import RECIPE_COSTS

    return RECIPE_COSTS[recipe]


def calibration_rows() -> list[tuple[tuple[int, int, int], float, float, str]]:
    from lowbit.runtime.observe.fp8_payoff import LinearShape, ModelWork, known_gpu, predict

    gpu = dataclasses.replace(known_gpu("H100"), memory_tbps=CALIBRATION_MEMORY_TBPS)
    rows = []
    for (m, k, n), published, role in CALIBRATION:
        work = ModelWork([LinearShape("linear", m, k, n)])
        rows.append(((m, k, n), published, predict(work, gpu, "tensorwise", torchao_cost("tensorwise")).speedup, role))
    return rows


def validation_rows(work=None) -> list[tuple[str, str, float, float, str]]:
    from lowbit.runtime.observe.fp8_payoff import first_last, known_gpu, predict

    work = work or llama3_8b_work()
    return [
        (
            gpu,
            recipe,
            published,
            predict(
                work, known_gpu(gpu), recipe, torchao_cost(recipe), first_last(work), recompute="op", shards=8
            ).speedup,
            source,
        )
        for gpu, recipe, published, source in VALIDATION
    ]


def auto_filter_rows(tokens: int = 8192) -> list[tuple[str, str, int, int, bool, bool, float]]:
    """Each layer shape of a few models: torchao's `_auto_filter_for_recipe` decision (convert?),
    lowbit's auto filter's, and lowbit's predicted layer speedup, on an H100, compiled."""
    import torch
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    from lowbit.runtime.observe.fp8_payoff import LinearShape, ModelWork, known_gpu, predict

    shapes = {
        "Llama-3-8B": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)],
        "Llama-3.2-1B": [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)],
        "GPT-2 small": [(768, 2304), (768, 768), (768, 3072), (3072, 768)],
    }
    gpu = known_gpu("H100")
    rows = []
    for recipe in ("tensorwise", "rowwise"):
        theirs = _auto_filter_for_recipe(recipe, [])
        for model, dims in shapes.items():
            for k, n in dims:
                layer = predict(
                    ModelWork([LinearShape("x", tokens, k, n)]), gpu, recipe, torchao_cost(recipe), auto=True
                ).layers[0]
                rows.append(
                    (
                        recipe,
                        model,
                        k,
                        n,
                        bool(theirs(torch.nn.Linear(k, n, device="meta"), "x")),
                        layer.low_s is not None,
                        layer.bf16_s / (layer.low_s or _low(layer, gpu, recipe)),
                    )
                )
    return rows


def _low(layer, gpu, recipe) -> float:
    from lowbit.runtime.observe.fp8_payoff import ModelWork, predict

    return predict(ModelWork([layer.layer]), gpu, recipe, torchao_cost(recipe)).layers[0].low_s


def main() -> int:
    print("Calibration: one tensorwise Linear, fwd+bwd, compiled, H100 at 2.4 TB/s (torchao's microbenchmark)")
    print(f"{'M x K x N':>20} {'published':>10} {'predicted':>10}  role")
    for (m, k, n), published, predicted, role in calibration_rows():
        print(f"{f'{m}x{k}x{n}':>20} {published:>10.2f} {predicted:>10.2f}  {role}")
    print("\nValidation: Llama-3-8B, 8 GPUs, seq 8192, compile, FSDP2, per-op SAC (not used to set anything)")
    print(f"{'GPU':<6} {'recipe':<18} {'published':>10} {'predicted':>10} {'error':>7}  within +-{TOLERANCE:.2f}")
    for gpu, recipe, published, predicted, _ in validation_rows():
        within = abs(predicted - published) <= TOLERANCE
        required = " (required)" if (gpu, recipe) in REQUIRED else ""
        print(
            f"{gpu:<6} {recipe:<18} {published:>10.2f} {predicted:>10.2f} {predicted - published:>+7.2f}  "
            f"{'yes' if within else 'no'}{required}"
        )
    print("\nAuto filter beside torchao's _auto_filter_for_recipe, H100, 8192 tokens, compiled (convert = True)")
    print(f"{'recipe':<11} {'model':<13} {'K x N':>12} {'torchao':>8} {'lowbit':>7} {'predicted':>10}")
    for recipe, model, k, n, theirs, ours, speedup in auto_filter_rows():
        mark = "" if theirs == ours else "  <- differs"
        print(f"{recipe:<11} {model:<13} {f'{k}x{n}':>12} {str(theirs):>8} {str(ours):>7} {speedup:>9.2f}x{mark}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
