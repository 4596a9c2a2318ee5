"""FP8 step time / BF16 step time, both through lowbit, same model, measured side by side.

    python bench/fp8_vs_bf16.py               # CPU: emulated FP8, eager and torch.compile'd
    python bench/fp8_vs_bf16.py --device cuda # a GPU: real FP8 GEMMs on sm_89+ (te or ao)

On CPU there are no FP8 GEMMs: torchao emulates them by dequantizing both operands and
multiplying in fp32 (torchao/float8/float8_ops.py: ``torch.mm(a._data.float() / a._scale, ...)``).
So compiled emulated fp8 runs at fp32 GEMM speed, which the fp32 column shows; whether that is
close to bf16 depends on the CPU's bf16 GEMMs. Target on CPU, compiled: fp8 / bf16 <= 1.15.
"""
from __future__ import annotations

import argparse
import warnings

import torch

from common import batch, compare, make_model, print_table, step_fn
from lowbit import Accelerator

warnings.filterwarnings("ignore")


def loop(precision: str, compiled: bool, device: str):
    acc = Accelerator(mixed_precision=precision, cpu=device == "cpu", dynamo_backend="inductor" if compiled else None)
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
    args = parser.parse_args()
    rows = []
    for compiled in (False, True):
        fp8, backend = loop("fp8", compiled, args.device)
        bf16, _ = loop("bf16", compiled, args.device)
        fp32, _ = loop("no", compiled, args.device)
        t8, t16, ratio = compare(fp8, bf16, pairs=args.pairs)
        _, t32, ratio32 = compare(fp8, fp32, pairs=args.pairs)
        target = "-" if not compiled or args.device != "cpu" else ("yes" if ratio <= 1.15 else "NO")
        rows.append((args.device, "compiled" if compiled else "eager", backend, t8 * 1e3, t16 * 1e3, ratio, target, t32 * 1e3, ratio32))
    print_table("fp8 step time / bf16 and / fp32 step time, through lowbit (median of adjacent-pair ratios)",
                ("device", "mode", "fp8 backend", "fp8 ms", "bf16 ms", "fp8/bf16", "<= 1.15", "fp32 ms", "fp8/fp32"), rows)


if __name__ == "__main__":
    main()
