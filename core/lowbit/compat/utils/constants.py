"""Accelerate's ``accelerate.utils.constants`` path: the lowest library versions each parallel
layout needs (the releases that brought the APIs lowbit calls)."""

# torch.distributed.tensor.parallel's parallelize_module with DTensor plans.
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
# transformers' from_pretrained(tp_plan="auto", device_mesh=...).
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"
# torch.distributed.tensor.experimental.context_parallel.
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"
# DeepSpeed's Ulysses sequence parallelism for transformers models.
BETA_SP_AVAILABLE_DEEPSPEED_VERSION = "0.18.2"

__all__ = ["BETA_TP_AVAILABLE_PYTORCH_VERSION", "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION", "BETA_CP_AVAILABLE_PYTORCH_VERSION",
           "BETA_SP_AVAILABLE_DEEPSPEED_VERSION"]
