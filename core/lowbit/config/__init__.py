"""Configuration: ``settings`` merges the YAML file, env vars and explicit arguments into one
validated ``LowbitConfig``; ``options`` says how one option is parsed and named; ``recipes`` holds
the recipe-kwargs classes plugins declare their options with.

``from lowbit.config import resolve_config`` reads from ``settings``, loaded on first use: the
settings read Accelerate's config names (``lowbit.compat``), which in turn use ``options``.
"""
from importlib import import_module
from typing import Any


def __getattr__(name: str) -> Any:
    return getattr(import_module("lowbit.config.settings"), name)
