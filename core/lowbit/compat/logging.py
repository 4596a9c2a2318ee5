"""``get_logger``: a logger that, in a multi-process run, logs on the main process only unless
asked otherwise (``logger.info(..., main_process_only=False)``, ``in_order=True``)."""

from __future__ import annotations

import logging
import os
from typing import Any


class MultiProcessAdapter(logging.LoggerAdapter):
    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        from lowbit.compat.state import PartialState

        state = PartialState()
        return not main_process_only or state.is_main_process

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        if not in_order:
            if self._should_log(main_process_only):
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        from lowbit.compat.state import PartialState

        state = PartialState()
        for rank in range(state.num_processes):  # each process in turn
            if rank == state.process_index:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning``, once per distinct message (as Accelerate's; TRL's trainers call it)."""
        key = (args, tuple(sorted(kwargs.items())))
        if key not in self._said_once:
            self._said_once.add(key)
            self.warning(*args, **kwargs)

    @property
    def _said_once(self) -> set:
        return self.__dict__.setdefault("_said_once_set", set())


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    log_level = log_level or os.environ.get("LOWBIT_LOG_LEVEL") or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
