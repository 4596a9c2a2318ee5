"""Cost of FP8 numerics telemetry: step time with it on / off, same lowbit fp8 model, side by side.

    python bench/telemetry.py

Off is lowbit's default: no hooks are installed, so the step is the plain fp8 step (whose
overhead over raw torchao is bench/overhead.py's fp8 row).
"""

from __future__ import annotations

import warnings

from common import compare, lowbit_loop, print_table

warnings.filterwarnings("ignore")


def main() -> None:
    off = lowbit_loop("fp8")
    rows = []
    for every in (1, 10, 100):
        on_ms, off_ms, ratio = compare(lowbit_loop("fp8", telemetry_every=every), off, pairs=150)
        rows.append((f"every {every} step(s)", on_ms * 1e3, off_ms * 1e3, ratio))
    print_table(
        "fp8 step time with telemetry on / off (median of adjacent-pair ratios)",
        ("telemetry", "on ms", "off ms", "ratio"),
        rows,
    )


if __name__ == "__main__":
    main()
