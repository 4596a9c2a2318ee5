"""Accelerate's ``accelerate.test_utils`` path: what a user's own tests import to skip by hardware,
reset state between tests and launch scripts (``testing``), and the tiny regression model and data
(``training``)."""

from lowbit.test_utils.scripts import test_ops, test_script, test_sync  # noqa: F401 - lowbit's own check scripts
from lowbit.test_utils.testing import *  # noqa: F401,F403
from lowbit.test_utils.testing import __all__ as _testing_names
from lowbit.test_utils.training import RegressionDataset, RegressionModel  # noqa: F401

__all__ = [*_testing_names, "RegressionDataset", "RegressionModel", "test_ops", "test_script", "test_sync"]
