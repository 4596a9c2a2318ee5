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

# Accelerate's vocabularies for FSDP settings (transformers' TrainingArguments checks fsdp= values against them).
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
# The file (or DCP folder) name of a model's FSDP checkpoint, as Accelerate and transformers' Trainer name it.
FSDP_MODEL_NAME = "pytorch_model_fsdp"

__all__ = [
    "FSDP_SHARDING_STRATEGY",
    "FSDP_AUTO_WRAP_POLICY",
    "FSDP_BACKWARD_PREFETCH",
    "FSDP_STATE_DICT_TYPE",
    "FSDP_MODEL_NAME",
    "BETA_TP_AVAILABLE_PYTORCH_VERSION",
    "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION",
    "BETA_CP_AVAILABLE_PYTORCH_VERSION",
    "BETA_SP_AVAILABLE_DEEPSPEED_VERSION",
]
