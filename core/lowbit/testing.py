"""The old path of the conformance kit, kept so plugins' test suites keep running: use
:mod:`lowbit.conformance` (``from lowbit.conformance import run_conformance``)."""

import warnings

from lowbit.compat.paths import alias_module

warnings.warn(
    "lowbit.testing is now lowbit.conformance (the plugin conformance kit); the old path is kept for "
    "now and will go in a later release: import from lowbit.conformance.",
    DeprecationWarning,
    stacklevel=2,
)
alias_module(__name__, "lowbit.conformance")
