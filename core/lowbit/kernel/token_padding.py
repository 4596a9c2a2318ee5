"""Odd token counts padded with zero rows around a layer, for backends whose low-precision GEMMs
need the token count (a GEMM dimension, the inner one of the weight gradient) to be a multiple.

A zero row adds nothing to the weight gradient, the bias gradient, any amax or any block's
scale, and its output row is dropped after the layer, so the results are those of the unpadded
batch. Used by lowbit-te (TE refuses odd counts) and lowbit-ao's block formats (MXFP8 and NVFP4
scale the tokens in blocks of 32 and 16 in the weight-gradient GEMM).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class PaddedForward:
    """A module's forward with its input tokens padded to ``multiple`` and its output unpadded, in
    one call: set as the module's ``forward``. (A pre-hook and a post-hook passed the shapes on a
    list, a side effect torch.compile cannot trace inside an activation-checkpointed block: one
    graph break per block.) Holds the module, not its bound forward, so copies stay whole."""

    def __init__(self, module: nn.Module, multiple: int, previous: Any = None):
        self.module, self.multiple, self.previous = module, multiple, previous

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        # the class's forward called with the module (torch 2.11's dynamo cannot trace binding it by __get__)
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self._forward(x, *args, **kwargs)
        tokens = math.prod(x.shape[:-1])
        missing = (-tokens) % self.multiple
        if not missing:
            return self._forward(x, *args, **kwargs)
        output = self._forward(F.pad(x.reshape(tokens, x.shape[-1]), (0, 0, 0, missing)), *args, **kwargs)
        return output[:tokens].reshape(*x.shape[:-1], output.shape[-1])


def pad_tokens(module: nn.Module, multiple: int) -> None:
    """Pad ``module``'s input tokens to ``multiple`` and unpad its output (idempotent). A re-run
    forward (activation checkpointing) pads and unpads the same way: nothing is kept between calls."""
    if isinstance(module.__dict__.get("forward"), PaddedForward):
        return
    module.forward = PaddedForward(module, multiple, module.__dict__.get("forward"))
