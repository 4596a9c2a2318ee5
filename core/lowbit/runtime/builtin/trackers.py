"""Built-in trackers, offered through the same hook a third-party tracker plugin uses."""

from __future__ import annotations

from lowbit.kernel.hookspecs import hookimpl


@hookimpl
def register_trackers():
    from lowbit.runtime.observe.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

    return {"tensorboard": TensorBoardTracker, "wandb": WandBTracker, "mlflow": MLflowTracker}
