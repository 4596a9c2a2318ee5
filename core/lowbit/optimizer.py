"""Accelerate's ``accelerate.optimizer`` path: the optimizer ``prepare`` returns."""
from lowbit.training.prepared import PreparedOptimizer

AcceleratedOptimizer = PreparedOptimizer

__all__ = ["AcceleratedOptimizer", "PreparedOptimizer"]
