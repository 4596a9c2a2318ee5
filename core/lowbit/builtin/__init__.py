"""Plugins that ship inside the core: hardware detection, native autocast, DDP and FSDP2.

They are plugins like any other (hook implementations describing themselves); the plugin manager
registers these modules before it loads the entry points of installed distributions."""

MODULES = (
    "lowbit.builtin.hardware",
    "lowbit.builtin.native_amp",
    "lowbit.builtin.ddp",
    "lowbit.builtin.fsdp",
    "lowbit.builtin.trackers",
)
