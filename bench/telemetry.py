"""Cost of FP8 numerics telemetry: step time with it on / off, same lowbit fp8 model, side by side.

    python bench/telemetry.py

Off is lowbit's default: no hooks are installed, so the step is the plain fp8 step (whose
overhead over raw torchao is bench/overhead.py's fp8 row).
"""
from __future__ import annotations

import warnings

import torch

from common import batch, compare, make_model, print_table, step_fn
from lowbit import Accelerator

warnings.filterwarnings("ignore")


def loop(telemetry_every: int | None):
    acc = Accelerator(mixed_precision="fp8")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    if telemetry_every:
        acc.enable_fp8_telemetry(every_n_steps=telemetry_every)
    return step_fn(model, opt, *batch(), backward=acc.backward)


def main() -> None:
    off = loop(None)
    rows = []
    for every in (1, 10, 100):
        on_ms, off_ms, ratio = compare(loop(every), off, pairs=150)
        rows.append((f"every {every} step(s)", on_ms * 1e3, off_ms * 1e3, ratio))
    print_table("fp8 step time with telemetry on / off (median of adjacent-pair ratios)",
                ("telemetry", "on ms", "off ms", "ratio"), rows)


if __name__ == "__main__":
    main()
