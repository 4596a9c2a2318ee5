"""lowbit's overhead: lowbit step time / raw PyTorch step time, same model, same precision.

    python bench/overhead.py            # eager and compiled, for fp32, bf16 and fp8 (ao, emulated on CPU)
    python bench/overhead.py --eager    # skip torch.compile (faster)

The raw loops do by hand what lowbit does: autocast (bf16, and fp8 inside bf16), torchao's
conversion with the same layer filter, the same optimizer. Target: median ratio <= 1.02.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import warnings

import torch

from common import batch, compare, lowbit_loop, make_model, print_table, step_fn
from lowbit.utils import AORecipeKwargs

warnings.filterwarnings("ignore")


def raw_loop(precision: str, compiled: bool):
    model = make_model()
    if precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from lowbit_ao.convert import default_module_filter

        module_filter, _ = default_module_filter(model, keep_first_last=True)
        config = dataclasses.replace(Float8LinearConfig(), emulate=not torch.cuda.is_available())
        convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
    if compiled:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    context = None if precision == "no" else (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    return step_fn(model, opt, *batch(), context=context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eager", action="store_true", help="eager mode only")
    parser.add_argument("--pairs", type=int, default=300, help="adjacent lowbit/raw step pairs per setting")
    args = parser.parse_args()
    rows = []
    for compiled in ([False] if args.eager else [False, True]):
        for precision in ("no", "bf16", "fp8"):
            # the raw loop runs torchao's own emulation; lowbit's is selected to match (the fast
            # default is measured against it in fp8_vs_bf16.py and peer.py)
            handlers = [AORecipeKwargs(emulation="torchao")] if precision == "fp8" else []
            ours, raw, ratio = compare(lowbit_loop(precision, compiled, handlers), raw_loop(precision, compiled), pairs=args.pairs)
            rows.append(("compiled" if compiled else "eager", precision, ours * 1e3, raw * 1e3, ratio, "yes" if ratio <= 1.02 else "NO"))
    print_table("lowbit / raw PyTorch step time (median of adjacent-pair ratios)",
                ("mode", "precision", "lowbit ms", "raw ms", "ratio", "<= 1.02"), rows)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
