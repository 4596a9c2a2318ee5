"""A one-feature linear regression to test training loops with: ``y = a * x + b`` plus noise."""

from __future__ import annotations

import numpy as np
import torch


class RegressionDataset:
    """``length`` samples ``{"x", "y"}`` of ``y = a * x + b`` with Gaussian noise (std 0.1)."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (a * self.x + b + rng.normal(scale=0.1, size=(length,))).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"x": self.x[index], "y": self.y[index]}


class RegressionModel(torch.nn.Module):
    """``a * x + b`` with two scalar parameters; ``double_output`` returns the prediction twice."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(float(a)))
        self.b = torch.nn.Parameter(torch.tensor(float(b)))
        self.double_output = double_output

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        prediction = x * self.a + self.b
        return (prediction, prediction) if self.double_output else prediction
