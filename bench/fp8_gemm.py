"""One FP8 GEMM on the CPU, every way lowbit can run it, against plain bf16 and fp32 GEMMs.

    python bench/fp8_gemm.py                 # n x n x n for n = 512, 1024, 2048
    python bench/fp8_gemm.py --sizes 256 512

Rows: ``torch._scaled_mm`` (torch's FP8 GEMM for the CPU, what ``emulate=False`` runs), torchao's
emulation (dequantize both operands to fp32, fp32 GEMM), lowbit's fast emulation in fp32 and in
bf16 (exact fp8 values, scales on the output), and plain bf16 / fp32 GEMMs. Median of repeats,
single-threaded, all in one process; the ratio column divides by the plain fp32 GEMM of that size.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from common import median_seconds

from lowbit.kernel.cpu_features import cpu_has_native_bf16

from lowbit_ao.fast_emulation import scaled_mm

torch.set_num_threads(1)


def median_ms(fn, repeats: int) -> float:
    return 1000 * median_seconds(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    native = cpu_has_native_bf16(when_unknown=False)
    print(
        f"CPU bf16 GEMMs: {'native (AVX512-BF16 or AMX)' if native else 'no native bf16 (slow path)'}; torch "
        f"{torch.__version__}"
    )
    print(f"{'n':>6} {'way':<34} {'ms':>9} {'/ fp32 mm':>10}")
    for n in args.sizes:
        g = torch.Generator().manual_seed(0)
        a, w = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        sa, sw = (448 / a.abs().max()).float(), (448 / w.abs().max()).float()
        a8, b8 = (a * sa).to(torch.float8_e4m3fn), (w * sw).to(torch.float8_e4m3fn).t()
        fa, fb = SimpleNamespace(_data=a8, _scale=sa), SimpleNamespace(_data=b8, _scale=sw)
        ab, bb = a.bfloat16(), w.t().bfloat16()
        ways = {
            "torch._scaled_mm (emulate=False)": lambda: torch._scaled_mm(
                a8, b8, scale_a=sa.reciprocal(), scale_b=sw.reciprocal(), out_dtype=torch.bfloat16
            ),
            "torchao emulation (fp32)": lambda: torch.mm(a8.float() / sa, b8.float() / sw).to(torch.bfloat16),
            "lowbit fast emulation, fp32 GEMM": lambda: scaled_mm(fa, fb, torch.bfloat16, torch.float32),
            "lowbit fast emulation, bf16 GEMM": lambda: scaled_mm(fa, fb, torch.bfloat16, torch.bfloat16),
            "plain bf16 mm": lambda: torch.mm(ab, bb),
            "plain fp32 mm": lambda: torch.mm(a, w.t()),
        }
        times = {name: median_ms(fn, args.repeats) for name, fn in ways.items()}
        for name, ms in times.items():
            print(f"{n:>6} {name:<34} {ms:>9.2f} {ms / times['plain fp32 mm']:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
