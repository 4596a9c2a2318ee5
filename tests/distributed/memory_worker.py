"""Measures one training process's peak memory for ``tests/core/observe/test_estimate_memory.py``: what the
process has allocated (glibc's ``mallinfo2``: heap in use plus mmapped blocks), from before the
model is built to the end of 3 training steps (every step must really step: a skipped one
allocates no optimizer states); sampled after every tensor operation (a dispatch
mode: forward, backward and the optimizer step alike), at each module's backward, and every
millisecond by a thread (for what happens inside one operation). The sample points after each
operation do not depend on how the machine schedules the thread, so under DDP the figure is the
same on a busy machine as on an idle one."""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


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


class SampleAfterEachOperation(TorchDispatchMode):
    """Samples once each operation has made its outputs (its inputs still alive): deterministic."""

    def __init__(self, sampler: PeakSampler) -> None:
        super().__init__()
        self.sampler = sampler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        self.sampler.sample()
        return out


def main() -> None:
    spec, precision, batch, seq, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    from lowbit import Accelerator

    from lowbit.runtime.observe.model_spec import example_inputs, load_model, load_model_on_meta

    accelerator = Accelerator(mixed_precision=precision)
    torch.manual_seed(0)
    meta = load_model_on_meta(spec)
    inputs = example_inputs(meta, batch, seq)
    real = (
        {k: torch.randint(0, 100, v.shape) for k, v in inputs.items()}
        if isinstance(inputs, dict)
        else torch.randn(inputs.shape)
    )
    before = allocated()
    sampler = PeakSampler()
    sampler.start()
    # Built for real, not meta.to_empty(): that leaves buffers uninitialised (a Llama's rotary
    # inv_freq), and garbage there once made the loss NaN, every step skipped, no AdamW states
    # allocated: a CI run measured 373 MB where the peak is 501.
    torch.manual_seed(0)
    model = load_model(spec, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    for module in model.modules():
        module.register_full_backward_hook(sampler.sample)
    skipped = []
    with SampleAfterEachOperation(sampler):
        for _ in range(3):
            output = model(**real) if isinstance(real, dict) else model(real)
            loss = output.loss if hasattr(output, "loss") else output.float().pow(2).mean()
            sampler.sample()  # every activation alive
            accelerator.backward(loss)
            optimizer.step()
            skipped.append(accelerator.optimizer_step_was_skipped)
            optimizer.zero_grad(set_to_none=True)
            del output, loss
    sampler.running = False
    sampler.join()
    with open(f"{out}/memory_rank{accelerator.process_index}.json", "w") as f:
        json.dump({"peak": sampler.peak - before, "strategy": accelerator.distributed_strategy, "skipped": skipped}, f)


if __name__ == "__main__":
    main()
