"""Accelerate's ``accelerate.local_sgd`` module path: ``from lowbit.compat.local_sgd import LocalSGD`` works as
it does there. The class lives with the training run, in :mod:`lowbit.runtime.training.local_sgd`."""

from lowbit.runtime.training.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
