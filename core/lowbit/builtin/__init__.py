"""Plugins that ship inside the core: hardware detection, native autocast, DDP and FSDP2."""
