"""Accelerate's ``accelerate.utils.other`` path."""
from lowbit.utils import extract_model_from_parallel  # noqa: F401
