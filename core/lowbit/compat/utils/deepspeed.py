"""Accelerate's ``accelerate.utils.deepspeed`` path. Its wrappers are the insides of Accelerate's
DeepSpeed integration; lowbit-deepspeed's prepare() returns its own. ``DummyOptim`` /
``DummyScheduler`` stand for an optimizer defined in the DeepSpeed config, which lowbit-deepspeed
does not build: the names import and raise on use, saying what to do."""

from __future__ import annotations

from lowbit.compat.accelerate_names import refusing_module

WHY = {
    "DummyOptim": "stands for an optimizer defined in the DeepSpeed config, which lowbit-deepspeed does not build",
    "DummyScheduler": "stands for a scheduler defined in the DeepSpeed config, which lowbit-deepspeed does not build",
}
USE = {
    "DummyOptim": "an optimizer made in the script (torch.optim.AdamW(...)) passed to accelerator.prepare, with no "
    "optimizer section in the DeepSpeed config",
    "DummyScheduler": "a scheduler made in the script passed to accelerator.prepare, with no scheduler section in the "
    "DeepSpeed config",
}
INSIDE = "is a wrapper inside Accelerate's DeepSpeed integration; lowbit-deepspeed's prepare() returns its own"


__getattr__ = refusing_module(
    __name__,
    lambda name: (
        WHY.get(name, INSIDE),
        USE.get(name, "what accelerator.prepare returns under distributed_type deepspeed"),
    ),
)
