"""Local SGD (``lowbit.runtime.training.local_sgd.LocalSGD``, where Accelerate has it): ranks step on their own
and average their parameters every few optimizer steps, instead of all-reducing every gradient."""

from __future__ import annotations

from typing import Any

from lowbit.runtime.training.operations import reduce


class LocalSGD:
    """Train without synchronising gradients, averaging the parameters every ``local_sgd_steps``
    optimizer steps (call ``step()`` after each one)."""

    def __init__(self, accelerator: Any, model: Any, local_sgd_steps: int, enabled: bool = True) -> None:
        self.accelerator, self.model, self.every = accelerator, model, local_sgd_steps
        self.enabled = enabled and accelerator.num_processes > 1
        self.steps = 0
        self._no_sync: Any = None

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._average()
            self._no_sync.__exit__(*exc)

    def step(self) -> None:
        self.steps += 1
        if self.enabled and self.steps % self.every == 0:
            self._average()

    def _average(self) -> None:
        import torch

        for param in self.model.parameters():
            param.data = reduce(param.data, reduction="mean")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
