"""Experiment trackers behind Accelerate's ``log_with`` / ``init_trackers`` / ``log`` / ``end_training``.

Each tracker library is imported only when that tracker is started; a missing one is an error
naming the pip package. Trackers come from plugins through the ``register_trackers`` hook: the
built-in ones (TensorBoard, W&B, MLflow) from ``lowbit.runtime.builtin.trackers``, others from anyone.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import warnings
from typing import Any

from lowbit.kernel import notices
from lowbit.kernel.errors import NOT_OFFERED_MARK, ConfigError, did_you_mean
from lowbit.kernel.tracker import GeneralTracker


class TensorBoardTracker(GeneralTracker):
    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | None = None, **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run_name = run_name
        self.logging_dir = os.path.join(logging_dir or "runs", run_name)
        self.writer = SummaryWriter(self.logging_dir, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
        self.writer.add_hparams(plain, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)) or (
                hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1
            ):
                self.writer.add_scalar(key, float(value), global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, {k: float(v) for k, v in value.items()}, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker(GeneralTracker):
    name = "wandb"

    def __init__(self, run_name: str, logging_dir: str | None = None, **kwargs: Any) -> None:
        import wandb

        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import wandb

        wandb.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(GeneralTracker):
    name = "mlflow"

    def __init__(self, run_name: str, logging_dir: str | None = None, **kwargs: Any) -> None:
        import mlflow

        if logging_dir:
            mlflow.set_tracking_uri(logging_dir)
        mlflow.set_experiment(run_name)
        self.run = mlflow.start_run(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import mlflow

        mlflow.log_params({k: str(v)[:250] for k, v in values.items()})

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import mlflow

        mlflow.log_metrics({k: float(v) for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


# Tracker name -> (module to import, pip package), for install hints and log_with="all".
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "aim": ("aim", "aim"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
}


# Accelerate's registry of trackers by name: the built-in ones, and each class given to
# ``register_tracker_class``. ``log_with`` names any of them (or one a plugin registers).
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    cls.name: cls for cls in (TensorBoardTracker, WandBTracker, MLflowTracker)
}


def register_tracker_class(cls: type[GeneralTracker]) -> type[GeneralTracker]:
    """Make ``cls`` nameable in ``log_with`` by its ``name``. It must subclass GeneralTracker and say
    its own ``name`` and ``requires_logging_directory``; a name already taken is replaced, with a warning."""
    if not (isinstance(cls, type) and issubclass(cls, GeneralTracker)):
        raise ConfigError(f"register_tracker_class takes a GeneralTracker subclass, got {cls!r}.")
    missing = [
        attr
        for attr in ("name", "requires_logging_directory")
        if not any(attr in vars(k) for k in cls.__mro__ if k is not GeneralTracker)
    ]
    if missing:
        raise ConfigError(
            f"{cls.__name__} must set {' and '.join(missing)} as class attributes to be registered "
            "(the name log_with uses, and whether it writes files under the project's logging_dir)."
        )
    if cls.name in LOGGER_TYPE_TO_CLASS and LOGGER_TYPE_TO_CLASS[cls.name] is not cls:
        warnings.warn(
            f"register_tracker_class: {cls.__name__} replaces {LOGGER_TYPE_TO_CLASS[cls.name].__name__} "
            f"as the tracker named {cls.name!r}.",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[cls.name] = cls
    return cls


def _not_built_in(class_name: str, name: str) -> type[GeneralTracker]:
    """Accelerate's tracker class for a library lowbit has no tracker for yet: it imports, and
    refuses to start, saying how to log there."""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            f"{class_name}: lowbit has no built-in {name!r} tracker yet. Use a GeneralTracker subclass "
            "for it (register_tracker_class, or a plugin's register_trackers hook), or log with "
            "tensorboard, wandb or mlflow."
        )

    return type(
        class_name,
        (GeneralTracker,),
        {
            "name": name,
            "__init__": refuse,
            "__doc__": f"Not built in: {name}.",
            NOT_OFFERED_MARK: f"has no built-in {name} tracker yet",
        },
    )


AimTracker = _not_built_in("AimTracker", "aim")
ClearMLTracker = _not_built_in("ClearMLTracker", "clearml")
CometMLTracker = _not_built_in("CometMLTracker", "comet_ml")
DVCLiveTracker = _not_built_in("DVCLiveTracker", "dvclive")
SwanLabTracker = _not_built_in("SwanLabTracker", "swanlab")
TrackioTracker = _not_built_in("TrackioTracker", "trackio")


def _installed(name: str) -> bool:
    module = TRACKER_PACKAGES.get(name, (None,))[0]
    return module is None or importlib.util.find_spec(module) is not None


def build_trackers(log_with: Any, registered: dict[str, type[GeneralTracker]]) -> list[Any]:
    """Normalise ``log_with`` ("all", a name, a GeneralTracker, or a list of them) into a list of
    names and tracker instances, checking each name now so a typo fails at ``Accelerator()``.
    ``registered`` are the tracker classes the plugins offer (``register_trackers``)."""
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    out: list[Any] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            out.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()
        if name == "all":
            out.extend(n for n in sorted(registered) if _installed(n))
            continue
        known = set(registered) | set(TRACKER_PACKAGES)
        if name not in known:
            raise ConfigError(
                f"Unknown tracker {name!r} in log_with.{did_you_mean(name, known)} Valid: {', '.join(sorted(known))}."
            )
        if not _installed(name):
            package = TRACKER_PACKAGES[name][1]
            raise ConfigError(
                f"log_with={name!r} needs the {package} package, which is not installed: `pip install {package}`."
            )
        if name not in registered:
            raise ConfigError(
                f"The {name!r} tracker is not built into lowbit yet: pass an instance of a GeneralTracker "
                "subclass in log_with, or add it through a plugin's register_trackers hook."
            )
        out.append(name)
    return out


def _check_logging_dir(name: str, cls: type[GeneralTracker], logging_dir: str | None) -> None:
    if cls.requires_logging_directory and logging_dir is None:
        raise ConfigError(
            f"The {name!r} tracker writes files: give Accelerator(project_dir=...) or "
            "project_config=ProjectConfiguration(logging_dir=...)."
        )


def start_trackers(
    requested: list[Any],
    registered: dict[str, type[GeneralTracker]],
    project_name: str,
    logging_dir: str | None,
    config: dict[str, Any] | None,
    init_kwargs: dict[str, dict[str, Any]],
) -> list[GeneralTracker]:
    trackers = []
    for item in requested:
        if isinstance(item, GeneralTracker):
            tracker = item
        else:
            cls = registered[item]
            _check_logging_dir(item, cls, logging_dir)
            kwargs = dict(init_kwargs.get(item, {}))
            # Accelerate's convention: the run name first; the logging directory to a tracker that takes one.
            if cls.requires_logging_directory or "logging_dir" in inspect.signature(cls).parameters:
                kwargs.setdefault("logging_dir", logging_dir)
            tracker = cls(project_name, **kwargs)
        tracker.start()
        if config is not None:
            tracker.store_init_configuration(config)
        trackers.append(tracker)
    return trackers


class Trackers:
    """The experiment trackers of one run: those named in ``log_with`` (checked at once), started
    on the main process by ``start``, no-ops elsewhere. ``registered`` are the tracker classes the
    plugins offer (the ``register_trackers`` hook)."""

    def __init__(
        self, log_with: Any, registered: dict[str, type[GeneralTracker]], logging_dir: str | None = None
    ) -> None:
        self.registered = registered
        self.requests = build_trackers(log_with, registered) if log_with is not None else []
        self.started: list[GeneralTracker] = []
        for item in self.requests:  # said when the Accelerator is made, as Accelerate does, not at init_trackers
            if isinstance(item, str):
                _check_logging_dir(item, registered[item], logging_dir)

    def start(
        self,
        project_name: str,
        logging_dir: str | None,
        config: dict[str, Any] | None,
        init_kwargs: dict[str, dict[str, Any]],
    ) -> None:
        # Started again (init_trackers twice): as in Accelerate the earlier trackers keep logging
        # next to the new ones and are finished at the end too, which a script rarely means: said.
        # A tracker object the user passed is not added twice.
        if self.started:
            notices.warn(
                f"init_trackers({project_name!r}) was called while trackers of an earlier init_trackers still "
                f"run ({', '.join(t.name for t in self.started)}): both sets log every value from now on, and "
                "both are finished by end_training(). To start a new run alone, call end_training() first."
            )
        new = start_trackers(self.requests, self.registered, project_name, logging_dir, config, init_kwargs)
        self.started += [t for t in new if not any(t is s for s in self.started)]

    def get(self, name: str, unwrap: bool = False) -> Any:
        for tracker in self.started:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        return GeneralTracker(name)  # a no-op on processes that run no tracker, as in Accelerate

    def log(
        self,
        values: dict[str, Any],
        step: int | None,
        log_kwargs: dict[str, dict[str, Any]],
        measured: dict[str, float] | None = None,
    ) -> None:
        """``values`` to every started tracker; then what lowbit ``measured`` (the throughput meter's
        figures), under the names ``values`` do not take."""
        for tracker in self.started:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))
        extra = {k: v for k, v in (measured or {}).items() if k not in values}
        if extra:
            for tracker in self.started:
                tracker.log(extra, step=step)

    def finish(self) -> None:
        for tracker in self.started:
            tracker.finish()
        self.started = []
