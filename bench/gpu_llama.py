"""FP8 against BF16 on a ~1B-parameter Llama-shaped model, one GPU: what a user wants to know.

    python bench/gpu_llama.py                      # compiled; every FP8 backend and recipe that runs here
    python bench/gpu_llama.py --shape llama3-8b-4l # Llama-3-8B's layer shapes, 4 layers, seq 8192, batch 1
    python bench/gpu_llama.py --steps 20 --seq 2048 --no-compile
    python bench/gpu_llama.py --device cpu --tiny --steps 2 --no-compile   # a smoke run (CI): no figures

Rows: lowbit bf16; raw PyTorch bf16 (the same loop by hand, bf16 autocast); lowbit with each
available FP8 backend and recipe (torchao tensorwise and rowwise, Transformer Engine delayed and
current scaling, MS-AMP O2); torchao applied by hand to the same model (``convert_to_float8_training``
on the same layers, bf16 autocast, the same AdamW), tensorwise and rowwise, which measures lowbit's
own overhead; and Hugging Face Accelerate's FP8 (torchao) where Accelerate is installed. Columns:
median step time, tokens per second, peak allocated memory, each against bf16; the ratio to the
raw row of the same work (raw bf16 for bf16, raw torchao of the same recipe for torchao rows);
model FLOPs utilisation against the GPU's dense bf16 peak; the graphs dynamo compiled and the
graph breaks it met (a compiled row with 0 graphs ran eager). AdamW is fused on a GPU.

Each row runs in its own process (clean memory peak), same seed, batch and AdamW, compiled with
``torch.compile`` unless ``--no-compile`` (torchao's speed-up depends on it; Transformer Engine
rows run eager: its DelayedScaling refuses compilation and its modules are fused already).
Needs ``transformers`` (the model is built from a config, random weights, nothing downloaded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

# (label, kind, fp8 backend, its recipe option) for the FP8 rows, in the order they run: each lowbit
# torchao row next to its hand-written twin, so that a run cut short still holds whole pairs; then
# Accelerate's, lowbit without its NaN check (the one host read per step), and the backends that have
# no raw twin here.
FP8_ROWS = [
    ("fp8 ao tensorwise", "lowbit", "ao", {"recipe": "tensorwise"}),
    ("raw torchao tensorwise", "raw_torchao", "ao", {"recipe": "tensorwise"}),
    ("fp8 ao rowwise", "lowbit", "ao", {"recipe": "rowwise"}),
    ("raw torchao rowwise", "raw_torchao", "ao", {"recipe": "rowwise"}),
    ("accelerate fp8 (ao)", "accelerate", "ao", {}),
    ("fp8 ao tensorwise continue", "lowbit_continue", "ao", {"recipe": "tensorwise"}),
    ("fp8 te delayed", "lowbit", "te", {"scaling": "delayed"}),
    ("fp8 te current", "lowbit", "te", {"scaling": "current"}),
    ("fp8 msamp O2", "lowbit", "msamp", {"opt_level": "O2"}),
]
# Seconds a row is given at least: with less of the budget left, the run stops before it.
MIN_ROW_S = 60

# Model shapes (LlamaConfig fields), and the sequence length and batch each is run at by default.
SHAPES = {
    # ~1B parameters, multi-head attention
    "llama-1b": (
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=32000,
        ),
        1024,
        4,
    ),
    # Llama-3-8B's layers (grouped-query attention, 8 key/value heads), 4 of them: 1.92 B parameters
    "llama3-8b-4l": (
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
        ),
        8192,
        1,
    ),
    # checks the script, measures nothing (grouped-query, as Llama 3)
    "tiny": (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
        32,
        2,
    ),
}


def model_config(seq: int, shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape][0], max_position_embeddings=seq, use_cache=False)


def _lowbit(model, optimizer, precision: str, backend: str | None, options: dict, on_nonfinite_loss: str = "skip"):
    from lowbit import Accelerator
    from lowbit.utils import FP8RecipeKwargs

    handlers = [FP8RecipeKwargs(backend=backend, **options)] if precision == "fp8" else []
    accelerator = Accelerator(mixed_precision=precision, kwargs_handlers=handlers, on_nonfinite_loss=on_nonfinite_loss)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, accelerator.backward, accelerator.device


def _raw_torchao(model, optimizer, device, options: dict):
    """torchao by hand: the layers lowbit's default converts (all Linears but the first and the last,
    dims divisible by 16), padded inner dims, bf16 autocast."""
    import dataclasses

    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model.to(device)
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    keep = {linears[0], linears[-1]}

    def eligible(module, fqn):
        return fqn not in keep and module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(options["recipe"]), pad_inner_dim=True, emulate=device.type != "cuda"
    )
    convert_to_float8_training(model, module_filter_fn=eligible, config=config)
    return _raw_bf16(model, optimizer, device)


def _raw_bf16(model, optimizer, device):
    """Plain PyTorch: the model on the device, its forward in bf16 autocast, written by hand."""
    import torch

    model.to(device)

    class Autocast(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return self.inner(*args, **kwargs)

    return Autocast(model), optimizer, lambda loss: loss.backward(), device


def _accelerate(model, optimizer, device):
    from accelerate import Accelerator
    from accelerate.utils import AORecipeKwargs

    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()], cpu=device.type == "cpu")
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, accelerator.backward, accelerator.device


def run_one(row: dict, args: argparse.Namespace) -> dict:
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import LlamaForCausalLM

    device = torch.device(args.device)
    config = model_config(args.seq, args.shape)
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: 1.9 B parameters initialised on a CPU take minutes
        model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    non_embedding = params - model.get_input_embeddings().weight.numel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if row["kind"] == "raw_torchao":
        model, optimizer, backward, device = _raw_torchao(model, optimizer, device, row["options"])
    elif row["kind"] == "raw_bf16":
        model, optimizer, backward, device = _raw_bf16(model, optimizer, device)
    elif row["kind"] == "accelerate":
        model, optimizer, backward, device = _accelerate(model, optimizer, device)
    elif row["kind"] == "lowbit_continue":
        model, optimizer, backward, device = _lowbit(
            model, optimizer, row["precision"], row["backend"], row["options"], on_nonfinite_loss="continue"
        )
    else:
        model, optimizer, backward, device = _lowbit(model, optimizer, row["precision"], row["backend"], row["options"])
    compiled = args.compile and row["backend"] != "te"
    step_model = torch.compile(model) if compiled else model
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(args.steps + args.warmup):
        sync()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = step_model(input_ids=tokens, labels=tokens).loss
        backward(loss)
        optimizer.step()
        sync()
        if step >= args.warmup:  # allocator, compilation, autotuning, FP8 scaling history
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step_s = statistics.median(times)
    token_count = args.batch * args.seq
    flops = (
        6 * non_embedding * token_count + 12 * config.num_hidden_layers * config.hidden_size * args.seq * token_count
    )
    # 6 N T for the weights (forward and backward) plus the attention scores (12 L H S T).
    return {
        "label": row["label"],
        "params": params,
        "step_ms": 1000 * step_s,
        "tokens_per_s": token_count / step_s,
        "tflops": flops / step_s / 1e12,
        "compiled": compiled,
        "final_loss": losses[-1],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
    }


def device_peak(device: str):
    """lowbit's figures for this GPU (lowbit.runtime.observe.gpu_specs), or None (a CPU, an unknown GPU)."""
    import torch

    from lowbit.runtime.observe.gpu_specs import gpu_peak

    if device != "cuda" or not torch.cuda.is_available():
        return None
    return gpu_peak(torch.cuda.get_device_name())


def predicted_speedups(args: argparse.Namespace, labels: list[str], gpu) -> dict[str, float]:
    """lowbit's FP8 payoff prediction for each FP8 row whose recipe a backend declares a cost for,
    on this GPU (on a CPU, for an H100: the smoke run checks the code, the figures mean nothing)."""
    import torch
    from transformers import LlamaForCausalLM

    from lowbit.cli.fp8_payoff_command import installed_costs

    from lowbit.kernel.errors import ConfigError

    from lowbit.runtime.observe.fp8_payoff import count_work, first_last, known_gpu, predict

    gpu = gpu if gpu is not None and gpu.memory_tbps else known_gpu("H100")
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config(args.seq, args.shape))
    work = count_work(model, args.batch, args.seq)
    predicted = {}
    for label, kind, backend, options in FP8_ROWS:
        # the row's recipe in lowbit's vocabulary (Accelerate's AORecipeKwargs defaults to tensorwise); MS-AMP has none
        recipe = options.get("recipe") or options.get("scaling") or ("tensorwise" if kind == "accelerate" else None)
        cost = installed_costs(backend).get(recipe)
        if label in labels and cost is not None:
            compiled = args.compile and backend != "te"
            with contextlib.suppress(ConfigError):  # this GPU has no tensor cores for the recipe's format
                predicted[label] = predict(work, gpu, recipe, cost[1], first_last(work), compiled=compiled).speedup
    return predicted


def rows_to_run(args: argparse.Namespace) -> list[dict]:
    import importlib.util

    from lowbit.cli.plugins_command import collect

    available = {r["name"] for r in collect()["plugins"] if r["role"] == "backend" and r["status"] == "available"}
    if args.device == "cpu":
        available.add("ao")  # emulated: a smoke run of the script, not a figure
    rows = [
        {"label": "bf16", "kind": "lowbit", "precision": "bf16", "backend": None, "options": {}},
        {"label": "raw bf16", "kind": "raw_bf16", "precision": "bf16", "backend": None, "options": {}},
    ]
    for label, kind, backend, options in FP8_ROWS:
        if backend not in available or (kind == "accelerate" and importlib.util.find_spec("accelerate") is None):
            continue
        rows.append({"label": label, "kind": kind, "precision": "fp8", "backend": backend, "options": options})
    return rows


def raw_counterpart(row: dict, results: list[dict]) -> dict | None:
    """The hand-written row doing the same work: raw bf16 for bf16 rows, raw torchao of the same
    recipe for torchao rows (Accelerate's default recipe: tensorwise); None for the others."""
    by_label = {r["label"]: r for r in results}
    if row["label"].startswith("raw "):
        return None
    if row["label"] == "bf16":
        return by_label.get("raw bf16")
    if row["backend"] == "ao":  # Accelerate's default recipe is tensorwise
        return by_label.get(f"raw torchao {row['options'].get('recipe', 'tensorwise')}")
    return None


def print_header(params: int, args: argparse.Namespace, peak) -> None:
    print(
        f"Llama-shaped model ({args.shape}), {params / 1e9:.2f} B parameters, batch {args.batch} x {args.seq} "
        f"tokens, AdamW, median of {args.steps} steps after {args.warmup}, {'compiled' if args.compile else 'eager'}"
        + ("" if peak else "; MFU: dense peak of this device unknown")
    )
    print(
        f"{'row':<28}{'step ms':>9}{'tok/s':>10}{'vs bf16':>9}{'predicted':>10}{'peak GiB':>10}{'vs bf16':>9}"
        f"{'vs raw':>9}{'MFU':>7}{'loss':>9}  compiled",
        flush=True,
    )


def row_line(r: dict, results: list[dict], args: argparse.Namespace, peak, predicted: dict[str, float]) -> str:
    """One row of the table; "vs raw" where its hand-written twin has run (for a raw row: its lowbit
    twin's ratio, so each pair's overhead shows as soon as the pair is done)."""
    base = results[0]
    raw = raw_counterpart(r, results)
    if raw is None and r["label"].startswith("raw "):
        twins = [t for t in results if raw_counterpart(t, results) is r and t["kind"] == "lowbit"]
        vs_raw = f"{twins[0]['step_ms'] / r['step_ms']:>8.3f}x" if twins else f"{'-':>9}"
    else:
        vs_raw = f"{r['step_ms'] / raw['step_ms']:>8.3f}x" if raw else f"{'-':>9}"
    graphs = f"  {r['graphs']} graphs, {r['graph_breaks']} breaks" if r["compiled"] else "  eager"
    mfu = f"{100 * r['tflops'] / peak:>6.1f}%" if peak else f"{'-':>7}"
    guess = f"{predicted[r['label']]:>9.2f}x" if r["label"] in predicted else f"{'-':>10}"
    return (
        f"{r['label'] + ('' if r['compiled'] or not args.compile else ' (eager)'):<28}{r['step_ms']:>9.1f}"
        f"{r['tokens_per_s']:>10.0f}{base['step_ms'] / r['step_ms']:>8.2f}x{guess}{r['peak_gib']:>10.2f}"
        f"{r['peak_gib'] / base['peak_gib']:>8.2f}x{vs_raw}{mfu}{r['final_loss']:>9.4f}{graphs}"
    )


def print_legend(gpu) -> None:
    print(
        "vs bf16: speed-up (bf16 step time / this one) and memory ratio; predicted: lowbit's FP8 payoff prediction "
        f"of that speed-up{'' if gpu and gpu.memory_tbps else ' (for an H100: this device has no figures)'} "
        "(docs/fp8-payoff.md); vs raw: step time / the hand-written row doing the same work (raw bf16, raw torchao "
        "of the same recipe), on a raw row its lowbit twin's: lowbit's and Accelerate's overhead; "
        "MFU against the dense bf16 peak."
    )


def run_row(cmd: list[str], timeout: float) -> tuple[str, str | dict]:
    """One row in its own process group, killed whole past ``timeout`` (a row cut short leaves no
    process on the GPU): ("ok", result), ("timeout", ""), or ("failed", stderr)."""
    from gpu_check import run_group  # beside this file (bench/ is the script's folder on sys.path)

    proc = run_group(cmd, timeout)
    if proc is None:
        return "timeout", ""
    if proc.returncode != 0:
        return "failed", proc.stderr
    return "ok", json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b", help="model shape (default: llama-1b)")
    parser.add_argument("--seq", type=int, help="tokens per row (default: the shape's)")
    parser.add_argument("--batch", type=int, help="rows per step (default: the shape's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny: checks the script, measures nothing")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--row-timeout", type=float, default=1800, help="seconds a row may take (default 1800)")
    parser.add_argument(
        "--budget",
        type=float,
        default=float("inf"),
        help="seconds for all rows: a row that would start with less than a minute left is not run",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.shape = "tiny" if args.tiny else args.shape
    args.seq = args.seq or SHAPES[args.shape][1]
    args.batch = args.batch or SHAPES[args.shape][2]
    if args.one:
        print(json.dumps(run_one(json.loads(args.one), args)))
        return
    deadline = time.monotonic() + args.budget
    gpu = device_peak(args.device)
    peak = gpu.tflops if gpu else None
    rows = rows_to_run(args)
    predicted = predicted_speedups(args, [r["label"] for r in rows], gpu)
    results: list[dict] = []
    for index, row in enumerate(rows):
        left = deadline - time.monotonic()
        if left < MIN_ROW_S:
            print(
                f"budget of {args.budget:.0f} s spent: not run: {', '.join(r['label'] for r in rows[index:])}",
                flush=True,
            )
            break
        cmd = [
            sys.executable,
            __file__,
            "--one",
            json.dumps(row),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--seq",
            str(args.seq),
            "--batch",
            str(args.batch),
            "--device",
            args.device,
            "--shape",
            args.shape,
            *([] if args.compile else ["--no-compile"]),
        ]
        print(f"running {row['label']} ...", file=sys.stderr, flush=True)
        timeout = min(args.row_timeout, left)
        status, result = run_row(cmd, timeout)
        if status != "ok":
            print(
                f"{row['label']}: "
                + (f"stopped after {timeout:.0f} s" if status == "timeout" else f"failed\n{result[-2000:]}"),
                file=sys.stderr,
                flush=True,
            )
            if index == 0:
                sys.exit("bf16 did not run: nothing to compare with")
            continue
        result.update(kind=row["kind"], backend=row["backend"], options=row["options"])
        results.append(result)
        if index == 0:
            print_header(result["params"], args, peak)
        print(row_line(result, results, args, peak, predicted), flush=True)
    print_legend(gpu)


if __name__ == "__main__":
    main()
