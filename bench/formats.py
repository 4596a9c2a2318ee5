"""Accuracy per number format: the same Llama-shaped model, data and seed trained in bf16, fp8
tensorwise, fp8 rowwise, MXFP8 and NVFP4, with the final loss and its gap to bf16.

    python bench/formats.py                  # CPU: FP8/MXFP8/NVFP4 GEMMs emulated (same numerics)
    python bench/formats.py --device cuda    # native where the GPU has the format (sm_89+, sm_100+)

The model is ``transformers.LlamaForCausalLM`` from a small config (random weights, no download),
the data the main job's sentences (``examples/char_gpt.py``), one character per token. Every
format runs in its own Accelerator from the same initial weights and the same batches; the final
loss is the mean of the last 20 steps. Writes a table (stdout, ``runs/formats.json``) and a plot
(``runs/formats.png``: loss curves and each format's difference from bf16).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from char_gpt import make_text  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.utils import AORecipeKwargs  # noqa: E402

# (label, mixed_precision, recipe)
FORMATS = [
    ("bf16", "bf16", None),
    ("fp8 tensorwise", "fp8", "tensorwise"),
    ("fp8 rowwise", "fp8", "rowwise"),
    ("mxfp8", "fp8", "mxfp8"),
    ("nvfp4", "fp4", "nvfp4"),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--formats",
        default=",".join(label for label, _, _ in FORMATS),
        help="comma-separated subset of: " + ", ".join(label for label, _, _ in FORMATS),
    )
    p.add_argument("--out", default=str(ROOT / "runs"))
    return p.parse_args(argv)


def make_model(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def train(
    label: str, precision: str, recipe: str | None, args: argparse.Namespace, data: torch.Tensor, vocab: int
) -> dict:
    handlers = [AORecipeKwargs(recipe=recipe)] if recipe else []
    accelerator = Accelerator(mixed_precision=precision, kwargs_handlers=handlers, cpu=args.device == "cpu")
    model = make_model(args, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(1)  # the same stochastic rounding draws for every run that uses them
    batches = torch.Generator().manual_seed(2)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(len(data) - args.seq - 1, (args.batch,), generator=batches)
        ids = torch.stack([data[s : s + args.seq] for s in starts]).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"  {label:<15} step {step + 1:>4}/{args.steps}  loss {loss.item():.4f}", flush=True)
    return {
        "format": label,
        "precision": precision,
        "recipe": recipe or "-",
        "losses": losses,
        "final_loss": sum(losses[-20:]) / min(20, len(losses)),
        "seconds": time.perf_counter() - start,
        "report": accelerator.fp8_report() or "",
        "emulated": accelerator._run.context.recipe_runs == "emulated",
    }


def table(results: list[dict]) -> str:
    base = next((r["final_loss"] for r in results if r["format"] == "bf16"), None)
    lines = [f"{'format':<15} {'final loss':>10} {'gap to bf16':>12} {'s/step':>7}  GEMMs", "-" * 60]
    for r in results:
        gap = "" if base is None or r["format"] == "bf16" else f"{r['final_loss'] - base:+.4f}"
        how = "emulated" if r["emulated"] else ("native" if r["precision"] != "bf16" else "bf16")
        lines.append(
            f"{r['format']:<15} {r['final_loss']:>10.4f} {gap:>12} {r['seconds'] / len(r['losses']):>7.3f}  {how}"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path, hardware: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    base = next((r["losses"] for r in results if r["format"] == "bf16"), None)
    for r in results:
        smooth = [
            sum(r["losses"][max(0, i - 9) : i + 1]) / len(r["losses"][max(0, i - 9) : i + 1])
            for i in range(len(r["losses"]))
        ]
        top.plot(smooth, label=r["format"] + (" (emulated)" if r["emulated"] else ""))
        if base is not None and r["format"] != "bf16":
            bsmooth = [sum(base[max(0, i - 9) : i + 1]) / len(base[max(0, i - 9) : i + 1]) for i in range(len(base))]
            bottom.plot([a - b for a, b in zip(smooth, bsmooth)], label=r["format"])
    top.set_ylabel("loss (10-step mean)")
    top.set_title(f"Same Llama-shaped model, data and seed per format ({hardware})")
    top.legend()
    bottom.axhline(0, color="grey", linewidth=0.5)
    bottom.set_ylabel("loss - bf16 loss")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    wanted = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in {label for label, _, _ in FORMATS}]
    if unknown:
        raise SystemExit(f"unknown format(s) {unknown}; choose from {[label for label, _, _ in FORMATS]}")
    text = make_text(4000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    hardware = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU: {platform.processor() or platform.machine()}"
    )
    print(
        f"{len(wanted)} formats x {args.steps} steps; Llama {args.layers} layers x {args.hidden}, "
        f"{args.batch}x{args.seq} tokens per step, on {hardware}",
        flush=True,
    )
    results = []
    for index, (label, precision, recipe) in enumerate(f for f in FORMATS if f[0] in wanted):
        print(f"[{index + 1} of {len(wanted)}] {label}", flush=True)
        results.append(train(label, precision, recipe, args, data, len(chars)))
    print()
    print(table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "formats.json").write_text(json.dumps({"hardware": hardware, "args": vars(args), "results": results}))
    plot(results, out / "formats.png", hardware)


if __name__ == "__main__":
    main()
