"""Accelerate's ``accelerate.optimizer`` path: the optimizer ``prepare`` returns."""

from lowbit.runtime.training.prepared import PreparedOptimizer

AcceleratedOptimizer = PreparedOptimizer

__all__ = ["AcceleratedOptimizer", "PreparedOptimizer"]
