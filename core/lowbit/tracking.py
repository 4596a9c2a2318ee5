"""Accelerate's ``accelerate.tracking`` module path: a custom tracker subclasses
``lowbit.tracking.GeneralTracker`` as it would ``accelerate.tracking.GeneralTracker``. The trackers
live with the rest of what observes a run, in :mod:`lowbit.observe.tracking`."""
from lowbit.observe.tracking import GeneralTracker, MLflowTracker, TensorBoardTracker, WandBTracker

__all__ = ["GeneralTracker", "MLflowTracker", "TensorBoardTracker", "WandBTracker"]
