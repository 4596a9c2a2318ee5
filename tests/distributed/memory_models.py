"""Models for ``tests/core/observe/test_estimate_memory.py`` given as ``module:factory`` (the worker and the
estimator import this file by path: tests/distributed is on sys.path there)."""

from __future__ import annotations

from torch import nn


def mlp_stack() -> nn.Module:
    """8 blocks of Linear(1024, 1024) + GELU, in a ModuleList as a transformer's blocks are."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8))
            self.head = nn.Linear(1024, 16)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Stack()


def lora_llama() -> nn.Module:
    """The FP8 LoRA tests' Llama (hidden 256, 2 layers) with PEFT's LoRA r=16 on every projection."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "ao"))
    from lora_helpers import lora_llama as build

    return build()
