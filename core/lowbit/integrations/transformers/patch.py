"""lowbit under transformers' ``Trainer`` and TRL's trainers, with the script unchanged.

``Trainer`` builds an Accelerate ``Accelerator`` from a global of ``transformers.trainer`` and sets
up processes with ``PartialState`` from a global of ``transformers.training_args``; TRL's trainers
subclass it. :func:`patch_trainer` points those globals (in the modules on the training path, and
only names lowbit really offers) at lowbit's, for modules loaded now and loaded later. What
``import accelerate`` gives other libraries is left as it is. Objects those modules build with
Accelerate's classes imported inside functions (``TorchDynamoPlugin``, ``DeepSpeedPlugin``, ...) are
translated field by field by the Accelerator (:mod:`lowbit.compat.accelerate_objects`).

``lowbit launch`` runs the script through :mod:`lowbit.cli.run_script`, which calls
:func:`patch_trainer` first (``LOWBIT_PATCH_TRAINER=0``: not); a script started with ``python`` or
``torchrun`` calls it itself. :func:`unpatch_trainer` puts Accelerate's names back.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any

from lowbit.integrations.transformers.training_modules import TRAINING_MODULES, TRAINING_PACKAGES

from lowbit.compat.accelerate_objects import lowbit_counterpart

# module name -> {global name: the Accelerate object it held}, to put back.
_SWAPPED: dict[str, dict[str, Any]] = {}


def is_training_module(name: str) -> bool:
    return name in TRAINING_MODULES or name.split(".", 1)[0] in TRAINING_PACKAGES


# What a Trainer gets instead of lowbit's plain class (see lowbit.integrations.transformers.trainer_accelerator).
UNDER_TRAINER = {"Accelerator": "TrainerAccelerator"}


def replacement(obj: Any) -> Any:
    """What a training module gets for Accelerate's ``obj``: lowbit's counterpart (the Trainer's
    own Accelerator for ``Accelerator``), or None when lowbit does not offer it."""
    counterpart = lowbit_counterpart(obj)
    if counterpart is not None and obj.__name__ in UNDER_TRAINER:
        return getattr(
            importlib.import_module("lowbit.integrations.transformers.trainer_accelerator"), UNDER_TRAINER[obj.__name__]
        )
    return counterpart


def _swap_module(module: Any) -> None:
    if module.__name__ in _SWAPPED:
        return
    swapped = {}
    for key, value in list(vars(module).items()):
        if isinstance(value, type(sys)):
            continue
        counterpart = replacement(value) if hasattr(value, "__name__") else _logger_counterpart(value)
        if counterpart is not None:  # a name lowbit does not offer keeps Accelerate's (the census test lists them)
            swapped[key] = value
            setattr(module, key, counterpart)
    if module.__name__ == "transformers.trainer":  # every Trainer's callbacks start with lowbit's figures
        from lowbit.integrations.transformers.trainer_accelerator import LowbitFiguresCallback

        swapped["DEFAULT_CALLBACKS"] = module.DEFAULT_CALLBACKS
        module.DEFAULT_CALLBACKS = [LowbitFiguresCallback, *module.DEFAULT_CALLBACKS]
    _SWAPPED[module.__name__] = swapped


def _logger_counterpart(value: Any) -> Any:
    """A logger the module made at import with Accelerate's ``get_logger`` (it asks Accelerate's
    process state, which lowbit does not start) becomes lowbit's logger of the same name."""
    if type(value).__module__ != "accelerate.logging" or not hasattr(value, "logger"):
        return None
    from lowbit.compat.logging import get_logger

    return get_logger(value.logger.name)


class _SwappingLoader(importlib.abc.Loader):
    """Runs the real loader, then swaps the new module's Accelerate names."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _swap_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... as the real loader's
        return getattr(self.loader, name)


class _TrainingModuleFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a training module, wraps the spec the other finders give."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not is_training_module(name):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _SwappingLoader(spec.loader)
                return spec
        return None


_FINDER = _TrainingModuleFinder()


def is_patched() -> bool:
    return _FINDER in sys.meta_path


def patch_trainer() -> None:
    """Make transformers' ``Trainer`` and TRL's trainers train with lowbit's Accelerator: in the
    training modules loaded now and loaded later. Calling it again does nothing;
    :func:`unpatch_trainer` undoes it."""
    if not is_patched():
        sys.meta_path.insert(0, _FINDER)
    for name, module in list(sys.modules.items()):
        if module is not None and is_training_module(name):
            _swap_module(module)


def unpatch_trainer() -> None:
    """Put Accelerate's names back where :func:`patch_trainer` put lowbit's."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name, swapped in _SWAPPED.items():
        module = sys.modules.get(name)
        if module is not None:
            for key, value in swapped.items():
                setattr(module, key, value)
    _SWAPPED.clear()
