"""Train a small GPT-style character model in fp32, bf16 and fp8, and compare them.

    python examples/char_gpt.py                          # CPU: sized to about 2 minutes on this machine
    python examples/char_gpt.py --device cuda --backend te --n_layer 12 --n_embd 768 --steps 2000
    lowbit launch --cpu --num_processes 2 examples/char_gpt.py --precisions fp8

The text is generated here from a tiny grammar (no download). Each precision trains the same
seeded model on the same batches. A table of final loss, step time and peak memory is printed
and the loss curves are written to a PNG. Without ``--steps`` the run is sized to this machine:
a few timed steps of each precision first, then as many steps (same for all) as fit
``--time_budget`` seconds, said up front with the reason (a CPU without native bf16 runs bf16 on a
slow path, many times fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from lowbit import Accelerator
from lowbit.utils import FP8RecipeKwargs

# This job prints its own progress line (speed included); lowbit's throughput line would break into it.
os.environ.setdefault("LOWBIT_THROUGHPUT_EVERY", "0")
# Bounds of the sized run: enough steps for the loss curves to mean something, no more than needed.
MIN_STEPS, MAX_STEPS = 60, 300
SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher", "our neighbour"]
VERBS = ["sees", "likes", "follows", "paints", "finds", "helps", "watches", "carries"]
OBJECTS = [
    "the red ball",
    "a green box",
    "the river",
    "an apple",
    "the moon",
    "a long letter",
    "the garden",
    "a tiny boat",
]
ENDINGS = ["today", "at night", "in the rain", "again", "with care", "before lunch", "every day", "slowly"]


def make_text(n_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}."
        for _ in range(n_sentences)
    )


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Progress:
    """A one-line progress bar on stderr (only on the main process), with the time left."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled, self.start = label, total, enabled, time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        done = int(30 * step / self.total)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        left = elapsed / step * (self.total - step)
        sys.stderr.write(
            f"\r{self.label} [{'#' * done}{'.' * (30 - done)}] {step}/{self.total} loss {loss:.3f} "
            f"{step / elapsed:.1f} it/s, {left:.0f} s left "
        )
        if step == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS of this process


def setup(precision: str, args: argparse.Namespace):
    """The corpus, and an Accelerator with the prepared model and optimizer for ``precision``."""
    text = make_text(args.sentences)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    mixed_precision = "no" if precision == "fp32" else precision
    handlers = [FP8RecipeKwargs(backend=args.backend)] if precision == "fp8" and args.backend else []
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        cpu=args.device == "cpu",
        kwargs_handlers=handlers,
        dynamo_backend="inductor" if args.compile else None,
    )
    torch.manual_seed(args.seed)
    model = CharGPT(len(chars), args.block_size, args.n_layer, args.n_embd, args.n_head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    return data, chars, accelerator, model, optimizer


def batch(data: torch.Tensor, args: argparse.Namespace, gen: torch.Generator, device: torch.device):
    starts = torch.randint(len(data) - args.block_size - 1, (args.batch_size,), generator=gen)
    x = torch.stack([data[s : s + args.block_size] for s in starts]).to(device)
    y = torch.stack([data[s + 1 : s + args.block_size + 1] for s in starts]).to(device)
    return x, y


def probe_step_seconds(precision: str, args: argparse.Namespace, steps: int = 3) -> float:
    """Median seconds of a training step in ``precision`` here, after one warm-up step."""
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(open(os.devnull, "w")):
        warnings.simplefilter("ignore")
        data, chars, accelerator, model, optimizer = setup(precision, args)
        gen = torch.Generator().manual_seed(args.seed)
        times = []
        for _ in range(steps + 1):
            x, y = batch(data, args, gen, accelerator.device)
            accelerator.set_batch_tokens(x.numel())  # batches made here, not by a prepared loader: tell the meter
            began = time.perf_counter()
            loss = F.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - began)
    return sorted(times[1:])[len(times[1:]) // 2]


def sized_steps(precisions: list[str], args: argparse.Namespace) -> int:
    """As many steps as fit the time budget for every precision, said up front with the reason."""
    seconds = {p: probe_step_seconds(p, args) for p in precisions}
    per_step = sum(seconds.values())
    steps = int(max(MIN_STEPS, min(MAX_STEPS, args.time_budget / per_step)) // 10 * 10)
    measured = ", ".join(f"{p} {1000 * s:.0f} ms" for p, s in seconds.items())
    why = ""
    if "bf16" in seconds and "fp32" in seconds and seconds["bf16"] > 3 * seconds["fp32"]:
        why = (
            f" bf16 takes {seconds['bf16'] / seconds['fp32']:.0f}x fp32 here: this CPU has no native bf16, so its "
            "bf16 matmuls take a slow path (fp8 is emulated inside bf16 autocast)."
        )
    # The estimate the chosen steps imply (MIN_STEPS can make it longer than the budget on a slow or busy machine).
    floor = f", the minimum of {MIN_STEPS} steps makes it longer" if steps * per_step > 1.05 * args.time_budget else ""
    print(
        f"char_gpt: {steps} steps per precision, about {steps * per_step:.0f} s of training on this machine (budget "
        f"{args.time_budget:.0f} s{floor}; measured per step: {measured}; --steps N to choose).{why}",
        flush=True,
    )
    return steps


def train(precision: str, args: argparse.Namespace) -> dict:
    data, chars, accelerator, model, optimizer = setup(precision, args)
    if precision == "fp8":
        accelerator.print(accelerator.explain_backend_choice())
    if args.fp8_stats_every and precision == "fp8":
        accelerator.enable_fp8_telemetry(every_n_steps=args.fp8_stats_every)
    gen = torch.Generator().manual_seed(args.seed + accelerator.process_index)
    progress = Progress(
        f"{precision} ({args.run_label})" if args.run_label else precision, args.steps, accelerator.is_main_process
    )
    losses, step_times = [], []
    profiler = accelerator.profile(f"runs/profile_{precision}") if args.profile else contextlib.nullcontext()
    with profiler as prof:
        for step in range(1, args.steps + 1):
            x, y = batch(data, args, gen, accelerator.device)
            accelerator.set_batch_tokens(x.numel())  # batches made here, not by a prepared loader: tell the meter
            began = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
            accelerator.backward(loss)
            optimizer.step()
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - began)
            losses.append(accelerator.gather(loss.detach()).mean().item())
            progress.update(step, losses[-1])
            if prof is not None:
                prof.step()
            if args.fp8_stats_every and precision == "fp8" and step % args.fp8_stats_every == 0:
                accelerator.print(f"\nFP8 numerics at step {step}:\n{accelerator.fp8_stats()}")
    if args.profile:
        accelerator.print(f"profile written to runs/profile_{precision}/ (trace_rank*.json, summary.txt)")
    warm = step_times[min(10, len(step_times) // 2) :]  # skip warm-up (and compilation) steps
    return {
        "precision": precision,
        "backend": accelerator.fp8_backend or "native",
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "step_ms": 1000 * sorted(warm)[len(warm) // 2],
        "peak_mb": peak_memory_mb(accelerator.device),
        "losses": losses,
        "is_main": accelerator.is_main_process,
        "emulated": precision == "fp8" and not accelerator.hardware.has_fp8_gemm,
        "hardware": accelerator.hardware.describe(),
    }


def run_isolated(precision: str, argv: list[str], steps: int, label: str) -> dict:
    """Run one precision in a fresh process, so its peak memory is its own (argparse keeps the
    last of a repeated flag, so the child's --precisions and --steps override the parent's)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run(
            [
                sys.executable,
                __file__,
                *argv,
                "--precisions",
                precision,
                "--steps",
                str(steps),
                "--run_label",
                label,
                "--result_file",
                str(out),
            ],
            check=True,
        )
        return json.loads(out.read_text())


def smoothed(losses: list[float], window: int = 10) -> list[float]:
    """The trailing mean over ``window`` steps (the raw per-step loss is too noisy to compare)."""
    return [
        sum(losses[max(0, i - window) : i + 1]) / len(losses[max(0, i - window) : i + 1]) for i in range(len(losses))
    ]


def report(results: list[dict], plot_path: str) -> None:
    base = next((r for r in results if r["precision"] == "fp32"), results[0])
    print(
        f"\n{'precision':<10}{'backend':<9}{'final loss':>11}{'step ms':>10}"
        f"{'vs ' + base['precision']:>9}{'peak MB':>10}"
    )
    for r in results:
        print(
            f"{r['precision']:<10}{r['backend']:<9}{r['final_loss']:>11.4f}{r['step_ms']:>10.1f}"
            f"{r['step_ms'] / base['step_ms']:>8.2f}x{r['peak_mb']:>10.0f}"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib to get the loss plot)")
        return
    # Left: the loss curves, and beneath them each precision's difference from the baseline, so
    # that curves lying on top of each other read as "the same", on purpose. Right: step time.
    fig = plt.figure(figsize=(11, 5.5))
    grid = fig.add_gridspec(2, 2, width_ratios=(2.2, 1), height_ratios=(2, 1))
    curves, diffs, bars = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[:, 1])
    base_curve = smoothed(base["losses"])
    for i, r in enumerate(results):
        curve = smoothed(r["losses"])
        label = f"{r['precision']} ({r['backend']})"
        curves.plot(range(1, len(curve) + 1), curve, label=label, color=f"C{i}")
        if r is not base:
            diffs.plot(range(1, len(curve) + 1), [a - b for a, b in zip(curve, base_curve)], label=label, color=f"C{i}")
    curves.set(ylabel="training loss (10-step mean)", title="char GPT: loss by precision")
    curves.legend()
    diffs.axhline(0.0, color="grey", linewidth=0.8)
    diffs.set(xlabel="step", ylabel=f"minus {base['precision']}")
    names = [r["precision"] + (" (emulated)" if r.get("emulated") else "") for r in results]
    drawn = bars.bar(names, [r["step_ms"] for r in results], color=[f"C{i}" for i in range(len(results))])
    bars.bar_label(drawn, labels=[f"{r['step_ms']:.0f} ms" for r in results])
    bars.set(ylabel="ms per step (median)", title=f"step time on {results[0].get('hardware', '?')}")
    if any(r.get("emulated") for r in results):
        bars.text(
            0.5, -0.16, "FP8 GEMMs emulated: no FP8 hardware here", transform=bars.transAxes, ha="center", fontsize=8
        )
    fig.tight_layout()
    Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot_path, dpi=120)
    print(f"loss curves written to {plot_path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="fp32,bf16,fp8", help="comma-separated: fp32, bf16, fp16, fp8")
    p.add_argument("--backend", default=None, help="fp8 backend (default: the best available; ao on CPU)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=None, help="steps per precision (default: sized to --time_budget)")
    p.add_argument("--time_budget", type=float, default=80.0, help="seconds of training, all precisions together")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sentences", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (dynamo_backend=inductor)")
    p.add_argument(
        "--profile", action="store_true", help="profile 3 steps with accelerator.profile(): runs/profile_<precision>/"
    )
    p.add_argument(
        "--fp8_stats_every", type=int, default=0, help="print FP8 numerics telemetry every N steps (fp8 run)"
    )
    p.add_argument("--plot", default="runs/char_gpt_loss.png")
    p.add_argument("--result_file", default=None, help=argparse.SUPPRESS)  # used by the isolated child runs
    p.add_argument("--run_label", default="", help=argparse.SUPPRESS)  # "2 of 3", on the child's progress line
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(train(precisions[0], args)))
        return
    if args.steps is None:
        args.steps = sized_steps(precisions, args) if not distributed else MAX_STEPS
    if len(precisions) > 1 and not distributed:
        results = [run_isolated(p, argv, args.steps, f"{i} of {len(precisions)}") for i, p in enumerate(precisions, 1)]
    else:
        results = [train(p, args) for p in precisions]
    if results and results[0]["is_main"]:
        report(results, args.plot)
        if any(math.isnan(r["final_loss"]) for r in results):
            sys.exit("a run diverged (NaN loss)")


if __name__ == "__main__":
    main()
