"""A rank that never stops on its own: it ignores SIGTERM, as a rank stuck in a collective does in
effect, and sleeps. For ``tests/core/training/test_preemption.py``: the launcher's grace kill must
reach it (torchrun starts each rank in a session of its own).

    lowbit launch --cpu --num_processes 2 tests/distributed/stuck_rank_worker.py OUT
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
(out / f"pid_{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
while True:
    time.sleep(1)
