"""Accelerate's ``accelerate.scheduler`` path: the LR scheduler ``prepare`` returns."""
from lowbit.training.prepared import PreparedScheduler

AcceleratedScheduler = PreparedScheduler

__all__ = ["AcceleratedScheduler", "PreparedScheduler"]
