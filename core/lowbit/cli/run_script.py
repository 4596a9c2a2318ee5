"""``python -m lowbit.cli.run_script [-m] SCRIPT [ARGS...]``: how ``lowbit launch`` starts a script.

It runs the script as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would: as ``__main__``,
with ``sys.argv`` and ``sys.path[0]`` as Python sets them. First it calls
:func:`lowbit.patch_trainer`, so that transformers' ``Trainer`` and TRL's trainers in an unchanged
script build lowbit's Accelerator (nothing else changes: ``import accelerate`` is untouched).
``LOWBIT_PATCH_TRAINER=0`` makes ``lowbit launch`` start the script directly instead.
"""

from __future__ import annotations

import os
import runpy
import sys
import zipfile
from typing import Mapping

from lowbit.kernel.env_numbers import env_switch

from lowbit.run.settings import PATCH_ENV


def patching_wanted(environ: Mapping[str, str] = os.environ) -> bool:
    return env_switch(PATCH_ENV, True, environ)


def main(argv: list[str]) -> None:
    if not argv or argv == ["-m"]:
        sys.exit("usage: python -m lowbit.cli.run_script [-m] SCRIPT [ARGS...]")
    from lowbit.integrations.transformers.patch import patch_trainer

    patch_trainer()  # before the script imports transformers (and after: modules loaded later are patched too)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        # As python sets it: the script's folder, or a folder (or zip) run by its __main__.py itself
        script = os.path.abspath(argv[0])
        runs_whole = os.path.isdir(script) or zipfile.is_zipfile(script)
        sys.path[0] = script if runs_whole else os.path.dirname(script)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
