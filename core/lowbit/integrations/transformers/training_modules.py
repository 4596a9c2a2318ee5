"""transformers' and TRL's modules that build and drive an Accelerator: ``patch_trainer`` gives
them lowbit's names. Other transformers modules (loading, big-model dispatch, quantizers) keep
Accelerate's: lowbit trains and does not dispatch. Changes when transformers or TRL move code."""

from __future__ import annotations

TRAINING_MODULES = frozenset(
    {
        "transformers.trainer",
        "transformers.training_args",
        "transformers.trainer_utils",
        "transformers.trainer_pt_utils",
        "transformers.trainer_callback",
        "transformers.trainer_seq2seq",
        "transformers.integrations.deepspeed",
        "transformers.integrations.integration_utils",
        "transformers.distributed.fsdp",
    }
)
# Every module of these packages trains (TRL's trainers, their callbacks and helpers).
TRAINING_PACKAGES = ("trl",)
