"""lowbit's overhead: lowbit step time / raw PyTorch step time, same model, same precision.

    python bench/overhead.py            # eager and compiled, for fp32, bf16 and fp8 (ao, emulated on CPU)
    python bench/overhead.py --eager    # skip torch.compile (faster)

The raw loops do by hand what lowbit does: autocast (bf16, and fp8 inside bf16), torchao's
conversion with the same layer filter, the same optimizer. lowbit runs with every default on (the
throughput meter, the non-finite check), on the same tensors as the raw loop.
"compiled" is lowbit's ``dynamo_backend="inductor"``; "torch.compile" compiles the prepared model
as a script does (``torch.compile(model)`` after ``prepare``). Each compiled row says how many
graphs lowbit's loop compiled and how many graph breaks it met (0 graphs: it ran eager). Run it
under each torch you support (the project's CI lanes: 2.13 and 2.11). Target: median ratio <= 1.02.
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


def compiled_lowbit_loop(precision: str, handlers: list):
    """lowbit's prepared model compiled by the script (torch.compile after prepare)."""
    from lowbit import Accelerator

    acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers)
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return step_fn(torch.compile(model), opt, *batch(), backward=acc.backward)


def dynamo_graphs_and_breaks(step) -> tuple[int, int]:
    """Graphs dynamo compiled and graph breaks it met over three steps of ``step`` (from a fresh dynamo)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for _ in range(3):
        step()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eager", action="store_true", help="eager mode only")
    parser.add_argument("--pairs", type=int, default=300, help="adjacent lowbit/raw step pairs per setting")
    args = parser.parse_args()
    rows = []
    modes = ["eager"] if args.eager else ["eager", "compiled", "torch.compile"]
    for mode in modes:
        for precision in ("no", "bf16", "fp8"):
            # the raw loop runs torchao's own emulation; lowbit's is selected to match (the fast
            # default is measured against it in fp8_vs_bf16.py and peer.py)
            handlers = [AORecipeKwargs(emulation="torchao")] if precision == "fp8" else []
            ours = (
                compiled_lowbit_loop(precision, handlers)
                if mode == "torch.compile"
                else lowbit_loop(precision, mode == "compiled", handlers)
            )
            graphs = "-" if mode == "eager" else "%d graphs, %d breaks" % dynamo_graphs_and_breaks(ours)
            ours_s, raw_s, ratio = compare(ours, raw_loop(precision, mode != "eager"), pairs=args.pairs)
            rows.append((mode, precision, ours_s * 1e3, raw_s * 1e3, ratio, "yes" if ratio <= 1.02 else "NO", graphs))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), `lowbit env` names the CPU")
    print_table(
        "lowbit / raw PyTorch step time (median of adjacent-pair ratios)",
        ("mode", "precision", "lowbit ms", "raw ms", "ratio", "<= 1.02", "lowbit compiled"),
        rows,
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
