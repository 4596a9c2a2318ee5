"""Prints the settings an Accelerator made from its launcher reached, one line per rank:
``SETTINGS <process index> <processes> <mixed_precision> <fp8 backend> <strategy> <autocast dtype>``."""

import sys

from lowbit import Accelerator

acc = Accelerator()
# One write per line: print() writes the text and the newline apart, and ranks interleave.
sys.stdout.write(
    f"SETTINGS {acc.process_index} {acc.num_processes} {acc.mixed_precision} {acc.fp8_backend} "
    f"{acc.distributed_strategy} {acc._run.context.autocast_dtype}\n"
)
sys.stdout.flush()
acc.end_training()
