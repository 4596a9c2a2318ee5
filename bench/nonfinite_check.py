"""What the non-finite gradient check costs: lowbit's step with it / without it, same model.

    python bench/nonfinite_check.py

lowbit reads every gradient once per optimizer step (on a GPU their total 2-norm, one fused kernel;
on a CPU one sum each) to catch a NaN/inf gradient under a finite loss, unless ``clip_grad_norm_``
already computed their norm that step. Both loops are lowbit's, side by side in one process; only
the check differs. Then the reduction alone, each way it could be done, on the benchmark model's
gradients.
"""

from __future__ import annotations

import warnings

import torch
from common import compare, lowbit_loop, make_model, median_seconds, print_table

warnings.filterwarnings("ignore")


def main() -> None:
    rows = []
    for precision in ("no", "bf16"):
        on_s, off_s, ratio = compare(lowbit_loop(precision), lowbit_loop(precision, check_gradients=False), pairs=150)
        rows.append((precision, on_s * 1000, off_s * 1000, ratio))
    print_table(
        "Non-finite gradient check: step time with / without (median of pair ratios)",
        ("precision", "with ms", "without ms", "ratio"),
        rows,
    )
    grads = [torch.randn_like(p) for p in make_model().parameters()]
    ways = {
        "total 2-norm (lowbit on a GPU)": lambda: torch.nn.utils.get_total_norm(grads, 2.0),
        "total max-norm": lambda: torch.nn.utils.get_total_norm(grads, float("inf")),
        "one sum per gradient (lowbit on a CPU)": lambda: torch.stack([g.sum(dtype=torch.float32) for g in grads]),
    }
    print_table(
        f"The reduction alone, {sum(g.numel() for g in grads) / 1e6:.2f} M fp32 gradients (median of 50)",
        ("way", "ms"),
        [(name, 1000 * median_seconds(way, 50)) for name, way in ways.items()],
    )


if __name__ == "__main__":
    main()
