"""FP8 step time / BF16 step time, both through lowbit, same model, measured side by side.

    python bench/fp8_vs_bf16.py               # CPU: both FP8 emulations, eager and torch.compile'd
    python bench/fp8_vs_bf16.py --device cuda # a GPU: real FP8 GEMMs on sm_89+ (te or ao)

On CPU there are no FP8 GEMMs, so lowbit-ao emulates them, in one of two ways (one row each):
``fast`` (the default: exact fp8 values multiplied in bf16 on CPUs with native bf16, else in
fp32, scales applied to the output) and ``torchao`` (torchao's emulate=True: operands dequantized
to fp32, fp32 GEMMs). The fp32 column shows where fp32 GEMMs bound the emulation; whether bf16 is
faster depends on the CPU's bf16 GEMMs (AVX512-BF16 / AMX). Targets on CPU: eager fp8 / bf16
<= 1.5, compiled <= 1.15. ``fast/torchao`` is the two emulations' step-time ratio, side by side.
``--all-fp8`` converts the model's first and last Linear too (by default they stay in bf16,
which on a CPU without native bf16 dominates the fp8 step).
"""

from __future__ import annotations

import argparse
import warnings

import torch
from common import batch, compare, make_model, print_table, step_fn

from lowbit import Accelerator
from lowbit.utils import AORecipeKwargs

warnings.filterwarnings("ignore")


def loop(precision: str, compiled: bool, device: str, emulation: str = "fast", all_fp8: bool = False):
    options = {"emulation": emulation} if device == "cpu" else {}
    if all_fp8:
        options["keep_first_last_high_precision"] = False
    handlers = [AORecipeKwargs(**options)] if precision == "fp8" and options else []
    acc = Accelerator(
        mixed_precision=precision,
        cpu=device == "cpu",
        dynamo_backend="inductor" if compiled else None,
        kwargs_handlers=handlers,
    )
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x, y = (t.to(acc.device) for t in batch())
    step = step_fn(model, opt, x, y, backward=acc.backward)
    if acc.device.type == "cuda":

        def synced() -> None:
            step()
            torch.cuda.synchronize()

        return synced, acc.fp8_backend
    return step, acc.fp8_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument(
        "--all-fp8", action="store_true", help="convert the first and last Linear too (by default they stay in bf16)"
    )
    args = parser.parse_args()
    rows = []
    emulations = ("fast", "torchao") if args.device == "cpu" else ("fast",)
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        bf16, _ = loop("bf16", compiled, args.device)
        fp32, _ = loop("no", compiled, args.device)
        fp8 = {emulation: loop("fp8", compiled, args.device, emulation, args.all_fp8) for emulation in emulations}
        for emulation, (step, backend) in fp8.items():
            t8, t16, ratio = compare(step, bf16, pairs=args.pairs)
            _, t32, ratio32 = compare(step, fp32, pairs=args.pairs)
            limit = 1.15 if compiled else 1.5
            target = f"{'yes' if ratio <= limit else 'NO'} (<= {limit})" if args.device == "cpu" else "-"
            label = f"{backend} ({emulation})" if args.device == "cpu" else backend
            rows.append((args.device, mode, label, t8 * 1e3, t16 * 1e3, ratio, target, t32 * 1e3, ratio32))
        if len(fp8) == 2:
            tf, tt, between = compare(fp8["fast"][0], fp8["torchao"][0], pairs=args.pairs)
            print(
                f"{mode}: fast emulation {tf * 1e3:.2f} ms / torchao emulation {tt * 1e3:.2f} ms = {between:.3f}",
                flush=True,
            )
    print_table(
        "fp8 step time / bf16 and / fp32 step time, through lowbit (median of adjacent-pair ratios)",
        ("device", "mode", "fp8 backend", "fp8 ms", "bf16 ms", "fp8/bf16", "target", "fp32 ms", "fp8/fp32"),
        rows,
    )


if __name__ == "__main__":
    main()
