"""Two fp8 Accelerators in one process, then a warning of the user's own (test_messages.py): lowbit's
notices must be said once, in one line, and leave other warnings as Python prints them.

    python tests/scripts/say_notices.py [--ignore-lowbit-notes]
"""

from __future__ import annotations

import sys
import warnings

from torch import nn

from lowbit import Accelerator

from lowbit.kernel.notices import LowbitNote

if "--ignore-lowbit-notes" in sys.argv:  # a user silencing lowbit's notes by their category
    warnings.filterwarnings("ignore", category=LowbitNote)
for _ in range(2):
    Accelerator(mixed_precision="fp8").prepare(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)))
warnings.warn("the user's own warning")
