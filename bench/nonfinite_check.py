"""What the non-finite gradient check costs: lowbit's step with it / without it, same model.

    python bench/nonfinite_check.py

lowbit reads every gradient once per optimizer step (one fused max-norm per device) to catch a NaN/inf gradient
under a finite loss, unless ``clip_grad_norm_`` already computed their norm that step. Both loops
are lowbit's, side by side in one process; only the check differs.
"""
from __future__ import annotations

import warnings

from common import compare, lowbit_loop, print_table

warnings.filterwarnings("ignore")


def main() -> None:
    rows = []
    for precision in ("no", "bf16"):
        on_s, off_s, ratio = compare(lowbit_loop(precision), lowbit_loop(precision, check_gradients=False), pairs=150)
        rows.append((precision, on_s * 1000, off_s * 1000, ratio))
    print_table("Non-finite gradient check: step time with / without (median of pair ratios)",
                ("precision", "with ms", "without ms", "ratio"), rows)


if __name__ == "__main__":
    main()
