"""Accelerate's ``accelerate.tracking`` module path: a custom tracker subclasses
``lowbit.compat.tracking.GeneralTracker`` as it would ``accelerate.tracking.GeneralTracker``. The trackers
live with the rest of what observes a run, in :mod:`lowbit.runtime.observe.tracking`."""

from lowbit.runtime.observe.tracking import (  # noqa: F401 - re-exported under Accelerate's path
    LOGGER_TYPE_TO_CLASS,
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    GeneralTracker,
    MLflowTracker,
    SwanLabTracker,
    TensorBoardTracker,
    TrackioTracker,
    WandBTracker,
    register_tracker_class,
)

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "register_tracker_class",
]
