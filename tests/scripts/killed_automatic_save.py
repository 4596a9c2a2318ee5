"""Saves three automatically named checkpoints (total_limit=2) and is SIGKILLed inside the third
save, after its first file: what ``test_nothing_lost.py`` then resumes from.

    python killed_automatic_save.py PROJECT_DIR
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

from lowbit import Accelerator
from lowbit.utils import ProjectConfiguration

from lowbit.runtime.checkpoint import files


def main() -> None:
    config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config, cpu=True)
    model = acc.prepare(nn.Linear(2, 2))
    real = files.write_file_atomically

    def killed_after_writing(obj, path, *args, **kwargs):
        real(obj, path, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    for step in range(3):
        with torch.no_grad():
            model.weight.fill_(float(step))
        if step == 2:
            files.write_file_atomically = killed_after_writing
        acc.save_state()


if __name__ == "__main__":
    main()
