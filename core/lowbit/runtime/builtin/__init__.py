"""Plugins that ship inside the core: hardware detection, DDP, FSDP2 and the trackers.

They are plugins like any other (hook implementations describing themselves); the plugin manager
registers these modules (``lowbit.run.plugin_manager.BUILTIN_PLUGINS``) before it loads the entry points
of installed distributions. What fp16, bf16 and fp32 mean (the autocast, loss scaling) is no
plugin's: the runtime's :class:`~lowbit.runtime.precision.Precision` answers it for every run."""
