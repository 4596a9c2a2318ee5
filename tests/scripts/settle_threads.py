"""Exits 0 when lowbit's exit path finds no other thread running (a fresh process has none), 1 if
it had to give up waiting (test_failing_ranks.py)."""

import sys

from lowbit.runtime.process_group import wait_for_native_threads_to_settle

sys.exit(0 if wait_for_native_threads_to_settle(timeout=300) else 1)
