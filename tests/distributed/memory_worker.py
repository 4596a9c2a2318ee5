"""Measures one training process's peak memory for ``tests/test_estimate_memory.py``: what the
process has allocated (glibc's ``mallinfo2``: heap in use plus mmapped blocks), from before the
model exists to the end of 3 training steps; sampled every millisecond by a thread, and at the
moments a peak can only happen (the loss computed, each module's backward), which a thread
that waits for the GIL could miss on a busy machine."""
from __future__ import annotations

import ctypes
import json
import sys
import threading
import time

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def allocated() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = allocated(), True

    def sample(self, *_: object) -> None:
        self.peak = max(self.peak, allocated())

    def run(self) -> None:
        while self.running:
            self.sample()
            time.sleep(0.001)


def main() -> None:
    spec, precision, batch, seq, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    from lowbit import Accelerator
    from lowbit.observe.memory_estimate import example_inputs, load_model_on_meta

    accelerator = Accelerator(mixed_precision=precision)
    torch.manual_seed(0)
    meta = load_model_on_meta(spec)
    inputs = example_inputs(meta, batch, seq)
    real = ({k: torch.randint(0, 100, v.shape) for k, v in inputs.items()} if isinstance(inputs, dict)
            else torch.randn(inputs.shape))
    before = allocated()
    sampler = PeakSampler()
    sampler.start()
    model = meta.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    for module in model.modules():
        module.register_full_backward_hook(sampler.sample)
    for _ in range(3):
        output = model(**real) if isinstance(real, dict) else model(real)
        loss = output.loss if hasattr(output, "loss") else output.float().pow(2).mean()
        sampler.sample()  # every activation alive
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del output, loss
    sampler.running = False
    sampler.join()
    with open(f"{out}/memory_rank{accelerator.process_index}.json", "w") as f:
        json.dump({"peak": sampler.peak - before, "strategy": accelerator.distributed_strategy}, f)


if __name__ == "__main__":
    main()
