"""Accelerate's config files and ``accelerate launch`` variables, read as lowbit settings.

A script moved from Accelerate keeps its precision, FP8 recipe, strategy and compile settings,
whether they come from a YAML file written by ``accelerate config`` (or one of Accelerate's
templates) or from the ``ACCELERATE_*`` / ``FSDP_*`` variables that ``accelerate launch`` exports.
Keys that only tune what lowbit does its own way are accepted and named once in a note; a key
that asks for something lowbit cannot do is an error, never a silent downgrade.
"""

from __future__ import annotations

from typing import Any, Mapping

from lowbit.kernel.env_numbers import ACCELERATE_FALSE, ACCELERATE_TRUE, accelerate_flag
from lowbit.kernel.errors import ConfigError
from lowbit.kernel.notices import note
from lowbit.kernel.types import normalize_name

# Top-level keys of Accelerate's config files with no meaning in lowbit (cloud, TPU, launcher
# details of other back ends).
IGNORED_TOP_LEVEL = frozenset(
    {
        "compute_environment",
        "main_training_function",
        "downcast_bf16",
        "same_network",
        "enable_cpu_affinity",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "tpu_name",
        "tpu_zone",
        "tpu_vm",
        "command_file",
        "commands",
        "use_mps_device",
        "ipex_config",
        "mpirun_config",
        "megatron_lm_config",
    }
)
# Accelerate's parallelism_config section spells each key with this prefix (parallelism_config_tp_size),
# and its launcher exports each as PARALLELISM_CONFIG_<KEY> with ACCELERATE_USE_PARALLELISM_CONFIG=true.
PARALLELISM_PREFIX = "parallelism_config_"
PARALLELISM_ENV_PREFIX = PARALLELISM_PREFIX.upper()
UNSUPPORTED_DISTRIBUTED_TYPES = {
    "MULTI_XPU": "Intel XPUs",
    "MULTI_NPU": "Ascend NPUs",
    "MULTI_MLU": "Cambricon MLUs",
    "MULTI_SDAA": "SDAA devices",
    "MULTI_MUSA": "Moore Threads GPUs",
    "MULTI_HPU": "Gaudi HPUs",
    "MULTI_NEURON": "AWS Neuron devices",
    "XLA": "TPUs (XLA)",
    "TPU": "TPUs (XLA)",
    "MEGATRON_LM": "Megatron-LM",
}
# YAML reads an unquoted `no` as false; for these keys it was meant as the word.
NO_AS_FALSE = {"mixed_precision": "no", "dynamo_backend": "no", "distributed_type": "NO", "fp8_fallback": "no"}

# dynamo_config's keys (dynamo_backend, dynamo_mode, dynamo_use_fullgraph, dynamo_use_dynamic,
# dynamo_use_regional_compilation) are lowbit's own top-level settings, under the same names.

# FSDP keys (fsdp_config in the file; FSDP_<KEY> variables from the launcher).
FSDP_LOWBIT_KEYS = (
    "transformer_layer_cls_to_wrap",
    "reshard_after_forward",
    "activation_checkpointing",
    "sync_module_states",
    "cpu_ram_efficient_loading",
)
FSDP_IGNORED = {
    "fsdp_version": "lowbit always uses FSDP2 (fully_shard)",
    "fsdp_backward_prefetch": "FSDP2 prefetches by itself",
    "fsdp_forward_prefetch": "FSDP2 prefetches by itself",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
    "fsdp_state_dict_type": "save_state writes lowbit's own checkpoint format",
    "fsdp_min_num_params": "lowbit shards by block, not by size",
    "fsdp_activation_checkpointing_offload": "checkpointed activations stay on the device",
}
# FSDP features lowbit does not offer: fine when off, an error when on.
FSDP_MUST_BE_OFF = {"fsdp_offload_params": "parameter offload to CPU"}
# FSDP1 sharding strategies (also accepted as fsdp_reshard_after_forward) as FSDP2's reshard flag.
SHARDING_TO_RESHARD = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False, "NO_RESHARD": False}

DEEPSPEED_IGNORED = {
    "zero3_init_flag": "build large models under deepspeed.zero.Init yourself",
    "zero3_save_16bit_model": "save_model gathers the full weights",
    "deepspeed_multinode_launcher": "lowbit launch starts each machine through torchrun",
    "deepspeed_hostfile": "lowbit launch starts each machine through torchrun",
    "deepspeed_exclusion_filter": "lowbit launch starts each machine through torchrun",
    "deepspeed_inclusion_filter": "lowbit launch starts each machine through torchrun",
    "offload_optimizer_nvme_path": "put the NVMe path in the DeepSpeed JSON config",
    "offload_param_nvme_path": "put the NVMe path in the DeepSpeed JSON config",
    "deepspeed_moe_layer_cls_names": "mark MoE layers in the DeepSpeed JSON config",
}


def translate_config_file(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An Accelerate config file's keys as lowbit's; a lowbit file passes through unchanged."""
    ignored: list[str] = []
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in IGNORED_TOP_LEVEL:
            ignored.append(key)
        elif key == "parallelism_config":
            out[key] = {k.removeprefix(PARALLELISM_PREFIX): v for k, v in (value or {}).items()}
        elif key == "dynamo_config":
            out.update(_translate_dynamo(value or {}))
        elif key == "fsdp_config":
            out[key] = translate_fsdp(value or {}, where, ignored)
        elif key == "deepspeed_config":
            out[key] = _translate_deepspeed(value or {}, ignored)
        elif key == "fp8_config" and isinstance(value, Mapping):
            out[key] = _translate_fp8(value)
        elif key == "num_processes" and value == -1:
            raise ConfigError(
                f"{where}: num_processes is -1 (Accelerate's 'ask the cluster'); give the total number of processes."
            )
        else:
            out[key] = NO_AS_FALSE[key] if value is False and key in NO_AS_FALSE else value
    _check_distributed_type(out.get("distributed_type"), where)
    note_ignored(where, ignored)
    return out


def loading_once_per_machine_env(distributed_type: str, fsdp_config: Mapping[str, Any]) -> dict[str, str]:
    """What ``accelerate launch`` exports for ``fsdp_cpu_ram_efficient_loading``: transformers'
    ``from_pretrained`` reads it (``is_fsdp_enabled``), and ranks above each machine's local rank 0
    leave what rank 0 will send uninitialised; prepare() fills every rank from rank 0."""
    if distributed_type.upper() != "FSDP" or not fsdp_config.get("cpu_ram_efficient_loading"):
        return {}
    return {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_SYNC_MODULE_STATES": "true"}


def _check_distributed_type(value: Any, where: str) -> None:
    if isinstance(value, str) and value.upper() in UNSUPPORTED_DISTRIBUTED_TYPES:
        raise ConfigError(
            f"{where}: distributed_type {value} ({UNSUPPORTED_DISTRIBUTED_TYPES[value.upper()]}) "
            "is not supported by lowbit, "
            "which trains on CUDA GPUs and CPUs. Use NO, MULTI_GPU, MULTI_CPU, FSDP or DEEPSPEED."
        )


def _translate_dynamo(section: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(section)  # every key is a top-level setting; validation names an unknown one
    if out.get("dynamo_backend") is False or str(out.get("dynamo_backend", "")).upper() == "NO":
        return {"dynamo_backend": "no"}
    if "dynamo_backend" in out:
        out["dynamo_backend"] = str(out["dynamo_backend"]).lower()
    return out


def translate_fsdp(section: Mapping[str, Any], where: str, ignored: list[str]) -> dict[str, Any]:
    """Accelerate's ``fsdp_*`` keys as lowbit's fsdp_config; lowbit's own keys pass through."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        if key == "fsdp_transformer_layer_cls_to_wrap":
            out["transformer_layer_cls_to_wrap"] = _names(value)
        elif key == "fsdp_activation_checkpointing":
            out["activation_checkpointing"] = (
                value if str(value).lower() in ("full", "selective") else _flag(value, key, where)
            )
        elif key in ("fsdp_sync_module_states", "fsdp_cpu_ram_efficient_loading"):
            out[key.removeprefix("fsdp_")] = _flag(value, key, where)
        elif key == "fsdp_reshard_after_forward":
            out["reshard_after_forward"] = _reshard(value, where)
        elif key in FSDP_IGNORED:
            ignored.append(f"fsdp_config.{key} ({FSDP_IGNORED[key]})")
        elif key in FSDP_MUST_BE_OFF:
            if _truthy(value):
                raise ConfigError(
                    f"{where}: fsdp_config.{key} asks for {FSDP_MUST_BE_OFF[key]}, which lowbit's FSDP2 strategy "
                    f"does not offer. Set it to false."
                )
        elif key == "fsdp_sharding_strategy":
            if str(value).upper() not in SHARDING_TO_RESHARD:
                raise ConfigError(
                    f"{where}: fsdp_config.fsdp_sharding_strategy {value!r} is not supported by lowbit's FSDP2 "
                    "strategy; use FULL_SHARD or SHARD_GRAD_OP (or DDP for NO_SHARD). For HYBRID_SHARD (HSDP), give a "
                    "parallelism_config with dp_replicate_size and dp_shard_size."
                )
            out.setdefault("reshard_after_forward", SHARDING_TO_RESHARD[str(value).upper()])
        elif key == "fsdp_auto_wrap_policy":
            if str(value).upper() != "TRANSFORMER_BASED_WRAP":
                ignored.append(
                    f"fsdp_config.fsdp_auto_wrap_policy={value} (lowbit shards each block of the model's "
                    "nn.ModuleLists, or the classes in fsdp_transformer_layer_cls_to_wrap)"
                )
        else:
            out[key] = value
    return out


def _flag(value: Any, key: str, where: str) -> bool:
    try:
        return parse_bool(value)
    except ValueError:
        raise ConfigError(f"{where}: fsdp_config.{key} must be true/false, got {value!r}.") from None


def _reshard(value: Any, where: str) -> bool:
    """FSDP2's flag, or an FSDP1 strategy name (Accelerate's launcher takes both)."""
    if str(value).upper() in SHARDING_TO_RESHARD:
        return SHARDING_TO_RESHARD[str(value).upper()]
    try:
        return parse_bool(value)
    except ValueError:
        raise ConfigError(
            f"{where}: fsdp_reshard_after_forward must be true/false or FULL_SHARD / SHARD_GRAD_OP / "
            f"NO_RESHARD, got {value!r}."
        ) from None


def _translate_fp8(section: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in section.items() if k != "use_mxfp8_block_scaling"}
    if "use_mxfp8_block_scaling" in section:
        out.update(_mxfp8_scaling(section["use_mxfp8_block_scaling"]))
    if isinstance(out.get("backend"), str):
        out["backend"] = normalize_name(out["backend"])
    return out


def _translate_deepspeed(section: Mapping[str, Any], ignored: list[str]) -> dict[str, Any]:
    out = {}
    for key, value in section.items():
        if key in DEEPSPEED_IGNORED:
            ignored.append(f"deepspeed_config.{key} ({DEEPSPEED_IGNORED[key]})")
        else:
            out[key] = value
    return out


def _names(value: Any) -> Any:
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return value


def parse_bool(value: Any) -> bool:
    """A boolean as Accelerate reads its env vars and config values (its ``str_to_bool``: y, yes, t,
    true, on, 1 and n, no, f, false, off, 0, in any case); ValueError for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ACCELERATE_TRUE or text in ACCELERATE_FALSE:
        return text in ACCELERATE_TRUE
    raise ValueError(f"{value!r} is not a truth value Accelerate reads")


def _truthy(value: Any) -> bool:
    try:
        return parse_bool(value)
    except ValueError:
        return bool(value)


def note_ignored(where: str, ignored: list[str]) -> None:
    """Name the accepted settings that do nothing here: once per process, on the main rank only
    (every rank reads the same file)."""
    if ignored:
        note(f"{where}: settings with no effect in lowbit, ignored: {', '.join(ignored)}.")


# ------------------------------------------------------------------ accelerate launch variables

FP8_ENV_PREFIX = "ACCELERATE_FP8_"
OVERRIDE_PARTS = ("OVERRIDE_FPROP", "OVERRIDE_DGRAD", "OVERRIDE_WGRAD")
# accelerate launch exports every --fp8_* flag, with its default when not given. Each backend
# takes its own keys; with no backend named, only the values a user changed are kept.
FP8_ENV_KEYS = {
    "te": (
        "USE_AUTOCAST_DURING_EVAL",
        "MARGIN",
        "INTERVAL",
        "FORMAT",
        "AMAX_HISTORY_LEN",
        "AMAX_COMPUTE_ALGO",
        "USE_MXFP8_BLOCK_SCALING",
        *OVERRIDE_PARTS,
    ),
    "msamp": ("OPT_LEVEL",),
    "ao": ("ENABLE_FSDP_FLOAT8_ALL_GATHER", "PAD_INNER_DIM"),
}
FP8_LAUNCHER_DEFAULTS = {
    "USE_AUTOCAST_DURING_EVAL": "false",
    "MARGIN": "0",
    "INTERVAL": "1",
    "FORMAT": "hybrid",
    "AMAX_HISTORY_LEN": "1024",
    "AMAX_COMPUTE_ALGO": "most_recent",
    "OPT_LEVEL": "o2",
    "ENABLE_FSDP_FLOAT8_ALL_GATHER": "true",
    "PAD_INNER_DIM": "true",
    "USE_MXFP8_BLOCK_SCALING": "false",
    **{part: "false" for part in OVERRIDE_PARTS},
}
DEEPSPEED_ENV = {
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "deepspeed_config_file",
}
DYNAMO_ENV = {
    "ACCELERATE_DYNAMO_BACKEND": "dynamo_backend",
    "ACCELERATE_DYNAMO_MODE": "dynamo_mode",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "dynamo_use_fullgraph",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "dynamo_use_dynamic",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "dynamo_use_regional_compilation",
}
WHERE_ENV = "ACCELERATE_* environment variables (set by accelerate launch)"


def settings_from_accelerate_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """What ``accelerate launch`` asked for, as raw lowbit config keys (empty when not under it)."""
    raw: dict[str, Any] = {}
    if _env_flag(environ, "ACCELERATE_USE_MEGATRON_LM"):
        raise ConfigError(f"{WHERE_ENV}: Megatron-LM is not supported by lowbit.")
    if environ.get("ACCELERATE_MIXED_PRECISION"):
        raw["mixed_precision"] = environ["ACCELERATE_MIXED_PRECISION"].lower()
    if environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        raw["gradient_accumulation_steps"] = environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"]
    if _env_flag(environ, "ACCELERATE_USE_CPU"):
        raw["use_cpu"] = True
    dynamo = {key: environ[env] for env, key in DYNAMO_ENV.items() if environ.get(env)}
    for key in [k for k in dynamo if k.startswith("dynamo_use_")]:  # Accelerate's truth values: t, y, On, ...
        dynamo[key] = _truthy(dynamo[key])
    raw.update(_translate_dynamo(dynamo))
    if _env_flag(environ, "ACCELERATE_USE_FSDP"):
        section = {
            "fsdp_" + name[len("FSDP_") :].lower(): value
            for name, value in environ.items()
            if name.startswith("FSDP_") and value != ""
        }
        if "fsdp_transformer_cls_to_wrap" in section:  # the launcher's shorter name for the same key
            section["fsdp_transformer_layer_cls_to_wrap"] = section.pop("fsdp_transformer_cls_to_wrap")
        raw.update(distributed_type="FSDP", fsdp_config=translate_fsdp(section, WHERE_ENV, []))
        raw["fsdp_config"] = {k: v for k, v in raw["fsdp_config"].items() if k in FSDP_LOWBIT_KEYS}
    if _env_flag(environ, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        raw["parallelism_config"] = {
            name[len(PARALLELISM_ENV_PREFIX) :].lower(): value
            for name, value in environ.items()
            if name.startswith(PARALLELISM_ENV_PREFIX)
            and value != ""
            and not name.startswith(PARALLELISM_ENV_PREFIX + "SP_")
        }
    if _env_flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        section = {key: environ[env] for env, key in DEEPSPEED_ENV.items() if environ.get(env)}
        raw.update(distributed_type="DEEPSPEED", deepspeed_config=section)
    fp8 = _fp8_from_env(environ)
    if fp8:
        raw["fp8_config"] = fp8
    return raw


def _fp8_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    backend = environ.get(FP8_ENV_PREFIX + "BACKEND", "")
    family = normalize_name(backend) if backend else ""
    wanted = FP8_ENV_KEYS.get(family) or tuple(key for keys in FP8_ENV_KEYS.values() for key in keys)
    given = {key: environ[FP8_ENV_PREFIX + key] for key in wanted if environ.get(FP8_ENV_PREFIX + key, "") != ""}
    if not family:
        given = {k: v for k, v in given.items() if v.strip().lower() != FP8_LAUNCHER_DEFAULTS.get(k)}
    fp8: dict[str, Any] = {"backend": family} if family else {}
    if any(part in given for part in OVERRIDE_PARTS):
        fp8["override_linear_precision"] = [given.get(part, "false") for part in OVERRIDE_PARTS]
    for key, value in given.items():
        if key == "USE_MXFP8_BLOCK_SCALING":
            fp8.update(_mxfp8_scaling(value))
        elif key not in OVERRIDE_PARTS:
            fp8["fp8_format" if key == "FORMAT" else key.lower()] = value
    return fp8


def _mxfp8_scaling(value: Any) -> dict[str, Any]:
    """Accelerate's ``use_mxfp8_block_scaling`` flag is the recipe vocabulary's ``recipe="mxfp8"``."""
    return {"recipe": "mxfp8"} if _truthy(value) else {}


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    return accelerate_flag(name, environ)
