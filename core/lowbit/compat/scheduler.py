"""Accelerate's ``accelerate.scheduler`` path: the LR scheduler ``prepare`` returns."""

from lowbit.runtime.training.prepared import PreparedScheduler

AcceleratedScheduler = PreparedScheduler

__all__ = ["AcceleratedScheduler", "PreparedScheduler"]
