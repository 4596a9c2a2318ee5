"""Host memory of each rank while a bf16-stored checkpoint is loaded in fp32 and prepared under
FSDP2 on 2 CPU processes, three ways side by side:

- ``every rank loads``: ``from_pretrained`` on both ranks, no setting;
- ``cpu_ram_efficient_loading``: the same under ``--fsdp_cpu_ram_efficient_loading true`` (lowbit
  exports Accelerate's variables; transformers decides what a rank above 0 reads);
- ``rank 0 loads``: rank 1 builds the model under ``init_empty_weights``, and prepare() fills its
  shards from rank 0.

Each rank's peak RSS (``ru_maxrss``) after prepare, in MB, and the size of the fp32 weights.

    python bench/rank0_loading_memory.py [--hidden 1024 --layers 8]

(The script is also the worker: ``lowbit launch`` runs it with ``--worker``.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=256,
    )  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import lowbit
    from lowbit import Accelerator

    accelerator = Accelerator(cpu=True)
    if args.way == "rank 0 loads" and accelerator.process_index > 0:
        with lowbit.init_empty_weights():
            model = LlamaForCausalLM(config(args.hidden, args.layers))
    else:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    loaded_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model = accelerator.prepare(model)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out, f"rank{accelerator.process_index}.json").write_text(
        json.dumps({"after_loading_mb": loaded_mb, "after_prepare_mb": peak_mb})
    )
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", default="", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config(args.hidden, args.layers))
        params = sum(p.numel() for p in model.parameters())
        model.to(torch.bfloat16).save_pretrained(Path(tmp, "ckpt"))
        del model
        fp32_mb, disk_mb = params * 4 / 2**20, params * 2 / 2**20
        print(f"{params / 1e6:.0f}M parameters: {fp32_mb:,.0f} MB in fp32, {disk_mb:,.0f} MB on disk")
        print(f"{'way':28} {'rank':>4} {'after loading MB':>17} {'after prepare MB':>17}")
        ways = {
            "every rank loads": [],
            "cpu_ram_efficient_loading": ["--fsdp_cpu_ram_efficient_loading", "true"],
            "rank 0 loads": ["--fsdp_cpu_ram_efficient_loading", "true"],
        }
        for way, flags in ways.items():
            out = Path(tmp, way.replace(" ", "_"))
            out.mkdir()
            command = [
                sys.executable, "-m", "lowbit.cli.main", "launch", "--cpu", "--num_processes", "2", "--use_fsdp",
                *flags, __file__, "--worker", "--way", way, "--checkpoint", str(Path(tmp, "ckpt")), "--out", str(out),
                "--hidden", str(args.hidden), "--layers", str(args.layers),
            ]  # fmt: skip
            env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_", "FSDP_"))}
            proc = subprocess.run(
                command, env={**env, "LOWBIT_CONFIG_FILE": os.devnull}, capture_output=True, text=True
            )
            if proc.returncode:
                print(f"{way}: failed\n{proc.stderr[-2000:]}")
                continue
            for rank in range(2):
                row = json.loads(Path(out, f"rank{rank}.json").read_text())
                print(f"{way:28} {rank:>4} {row['after_loading_mb']:>17,.0f} {row['after_prepare_mb']:>17,.0f}")


if __name__ == "__main__":
    main()
