"""What a tracker is: the base class every tracker derives from, the built-in ones
(:mod:`lowbit.runtime.observe.tracking`) and those a plugin offers through ``register_trackers``.
Accelerate's path for it is ``lowbit.tracking.GeneralTracker``."""

from __future__ import annotations

from typing import Any


class GeneralTracker:
    """A tracker: ``store_init_configuration`` once, ``log`` per step, ``finish`` at the end.
    ``tracker`` is the underlying library object (``get_tracker(name, unwrap=True)``)."""

    name = "general"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        # A subclass written as Accelerate's docs show calls ``super().__init__()`` with nothing.
        self.run_name = run_name

    @property
    def tracker(self) -> Any:
        return self

    def start(self) -> None:
        """Open the run (files, connections), called by ``init_trackers`` on the process that logs,
        before ``store_init_configuration``: a tracker made earlier holds nothing open until then."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        pass

    def finish(self) -> None:
        pass
