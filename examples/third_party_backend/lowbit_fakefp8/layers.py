"""The layer the fakefp8 backend swaps in. Imported only once the backend is chosen."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

E4M3_MAX = 448.0


def fake_fp8(weight: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 with a per-tensor scale; the gradient passes straight through."""
    scale = E4M3_MAX / weight.detach().abs().amax().clamp(min=1e-12)
    rounded = (weight * scale).to(torch.float8_e4m3fn).to(weight.dtype) / scale
    return weight + (rounded - weight).detach()


class FakeFP8Linear(nn.Linear):
    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FakeFP8Linear":
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # the same parameters: checkpoints stay portable
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_fp8(self.weight), self.bias)
