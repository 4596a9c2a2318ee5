"""FP8 LoRA in several processes, started by ``lowbit launch`` (2 CPU processes over gloo):

    lowbit launch --cpu --num_processes 2 [--use_fsdp] --mixed_precision fp8 lora_worker.py OUT FROZEN_BASES

FROZEN_BASES is ``fp8`` or ``high_precision`` (AORecipeKwargs(frozen_bases=...)). Each rank trains
a PEFT LoRA Llama for 4 steps and writes ``OUT/result_<rank>.json``: the bytes its collectives
moved in the last step (all-gathers, all-reduces), the dtype and shape each frozen base's weight had
in its forward (what FSDP2 gathered), the losses, and a checksum of its adapters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_helpers import batch, lora_llama  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.utils import AORecipeKwargs  # noqa: E402

STEPS = 4


class CollectiveBytes:
    """Bytes the collectives of interest moved (by wrapping torch.distributed's functions)."""

    def __init__(self):
        self.gathered = self.reduced = 0
        # FSDP2 gathers with all_gather_single (torch 2.13) or all_gather_into_tensor (older)
        for name, kind in (
            ("all_gather_single", "gathered"),
            ("all_gather_into_tensor", "gathered"),
            ("all_reduce", "reduced"),
        ):
            if hasattr(dist, name):
                self._wrap(name, kind)

    def _wrap(self, name: str, kind: str) -> None:
        original = getattr(dist, name)

        def counted(tensor, *args, **kwargs):
            setattr(self, kind, getattr(self, kind) + tensor.numel() * tensor.element_size())
            return original(tensor, *args, **kwargs)

        setattr(dist, name, counted)

    def reset(self) -> None:
        self.gathered = self.reduced = 0


def main() -> None:
    out, frozen_bases = Path(sys.argv[1]), sys.argv[2]
    counted = CollectiveBytes()
    acc = Accelerator(kwargs_handlers=[AORecipeKwargs(frozen_bases=frozen_bases)])
    model = lora_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    seen = {}

    def record(module, args):
        seen[type(module).__name__] = [str(module.weight.dtype), list(module.weight.shape)]

    for name, module in acc.unwrap_model(model).named_modules():
        if name.endswith("layers.1.mlp.up_proj.base_layer"):
            module.register_forward_pre_hook(record)
    losses = []
    for i in range(STEPS):
        counted.reset()
        ids = batch(10 * i + acc.process_index)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    inner = acc.unwrap_model(model)
    trainable = [p for p in inner.parameters() if p.requires_grad]
    adapters = sum(float((p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum()) for p in trainable)
    logging_data = model._get_ddp_logging_data() if hasattr(model, "_get_ddp_logging_data") else {}
    result = {
        "ddp_bucket_sizes": str(logging_data.get("bucket_sizes", "")),
        "gathered_bytes": counted.gathered,
        # a DTensor's numel is its whole tensor's
        "frozen_fp8_elements": sum(m.weight.numel() for m in inner.modules() if type(m).__name__ == "FrozenFP8Linear"),
        "reduced_bytes": counted.reduced,
        "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "frozen_base_in_forward": seen,
        "losses": losses,
        "adapter_checksum": adapters,
        "fp8_report": acc.fp8_report(),
        "strategy": acc.distributed_type.value if hasattr(acc.distributed_type, "value") else str(acc.distributed_type),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"result_{acc.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
