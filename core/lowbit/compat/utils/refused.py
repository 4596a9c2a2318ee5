"""Names of ``accelerate.utils`` for jobs lowbit does not do, each with why and what to use: they
import (a script's imports keep working) and raise UnsupportedCombinationError when used."""

from __future__ import annotations

from typing import Any

from lowbit.compat.accelerate_names import INFERENCE_USE, INFERENCE_WHY, not_offered

_MEGATRON = (
    "belongs to Accelerate's Megatron-LM integration, which lowbit does not offer",
    "FSDP2 or tensor parallelism (ParallelismConfig), or Accelerate with Megatron-LM",
)
_FSDP2_INSIDE = (
    "is a step of FSDP2 preparation that lowbit's fsdp strategy takes inside prepare()",
    "accelerator.prepare(model, optimizer) with distributed_type fsdp (or FullyShardedDataParallelPlugin)",
)
_TE_INSIDE = (
    "is a step of Transformer Engine conversion that lowbit-te takes inside prepare()",
    "Accelerator(mixed_precision='fp8', kwargs_handlers=[TERecipeKwargs()]) and accelerator.prepare(model)",
)
_QUANTIZE = (
    "quantizes a model with bitsandbytes for inference, which lowbit does not do (it trains)",
    "Accelerate's or transformers' BitsAndBytesConfig",
)

# name -> (what it does that lowbit does not, what to use)
REFUSED: dict[str, tuple[str, str]] = {
    **{
        name: _MEGATRON
        for name in (
            "MegatronLMPlugin",
            "MegatronLMDummyDataLoader",
            "MegatronLMDummyScheduler",
            "AbstractTrainStep",
            "BertTrainStep",
            "GPTTrainStep",
            "T5TrainStep",
            "avg_losses_across_data_parallel_group",
        )
    },
    **{
        name: _FSDP2_INSIDE
        for name in (
            "fsdp2_prepare_model",
            "fsdp2_load_full_state_dict",
            "fsdp2_switch_optimizer_parameters",
            "enable_fsdp_ram_efficient_loading",
            "disable_fsdp_ram_efficient_loading",
        )
    },
    **{name: _TE_INSIDE for name in ("apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model")},
    **{name: _QUANTIZE for name in ("BnbQuantizationConfig", "load_and_quantize_model")},
    **{
        name: (INFERENCE_WHY, INFERENCE_USE)
        for name in (
            "get_balanced_memory",
            "get_max_memory",
            "infer_auto_device_map",
            "offload_state_dict",
            "load_offloaded_weights",
            "OffloadedWeightsLoader",
        )
    },
    "install_xla": ("installs torch_xla for TPUs, on which lowbit does not train", "Accelerate on TPUs"),
    "set_numa_affinity": (
        "pins processes to GPUs' NUMA nodes, which lowbit does not do",
        "numactl (or Accelerate's launcher with --enable_cpu_affinity)",
    ),
    "override_numa_affinity": (
        "pins processes to GPUs' NUMA nodes, which lowbit does not do",
        "numactl (or Accelerate's launcher with --enable_cpu_affinity)",
    ),
    "get_mixed_precision_context_manager": (
        "reads a process-wide precision, which lowbit does not keep: each Accelerator has its own",
        "accelerator.autocast()",
    ),
}


def refused(name: str) -> Any:
    why, use = REFUSED[name]
    return not_offered(f"accelerate.utils.{name}", why, use, is_class=name[:1].isupper())
