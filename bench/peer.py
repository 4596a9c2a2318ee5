"""lowbit against Hugging Face Accelerate on the same model, both with default settings.

    pip install accelerate          # bench-only: `pip install -e ".[bench]"`
    python bench/peer.py

bf16, and fp8 through each one's torchao path. On CPU Accelerate needs to be told to emulate
(its default Float8LinearConfig runs torchao's non-emulated path), so its fp8 gets
`Float8LinearConfig(emulate=True)`: torchao's emulation. lowbit's fp8 runs twice: with its
default (the fast emulation) and with `emulation="torchao"`, the same settings as Accelerate's.
Printed: lowbit step time / Accelerate step time.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from common import batch, compare, lowbit_loop, make_model, print_table, step_fn

warnings.filterwarnings("ignore")


def accelerate_loop(precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import AORecipeKwargs

    # Accelerate keeps one process-global state and refuses a second Accelerator with other
    # settings ("AcceleratorState has already been initialized"); reset it between setups.
    AcceleratorState._reset_state(reset_partial_state=True)
    handlers = []
    if precision == "fp8":
        from torchao.float8 import Float8LinearConfig

        handlers = [AORecipeKwargs(config=Float8LinearConfig(emulate=not torch.cuda.is_available()))]
    acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers, cpu=not torch.cuda.is_available())
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    return step_fn(model, opt, *batch(), backward=acc.backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=200)
    args = parser.parse_args()
    try:
        import accelerate
    except ImportError:
        raise SystemExit("This benchmark needs Hugging Face Accelerate: pip install accelerate") from None
    from lowbit.utils import AORecipeKwargs

    rows = []
    setups = [("bf16", "bf16", None), ("fp8", "fp8 (lowbit default)", None)]
    if not torch.cuda.is_available():
        setups.append(("fp8", "fp8 (emulation='torchao')", [AORecipeKwargs(emulation="torchao")]))
    for precision, label, handlers in setups:
        try:
            peer = accelerate_loop(precision)
        except Exception as exc:  # noqa: BLE001 - report what the peer does, do not crash the table
            rows.append(
                (label, "-", "-", "-", f"Accelerate {accelerate.__version__} failed: {type(exc).__name__}: {exc}"[:120])
            )
            continue
        ours, theirs, ratio = compare(lowbit_loop(precision, handlers=handlers), peer, pairs=args.pairs)
        rows.append((label, ours * 1e3, theirs * 1e3, ratio, ""))
    print_table(
        f"lowbit / Accelerate {accelerate.__version__} step time (median of adjacent-pair ratios)",
        ("precision", "lowbit ms", "Accelerate ms", "ratio", "note"),
        rows,
    )


if __name__ == "__main__":
    main()
