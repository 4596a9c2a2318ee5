"""Build the DeepSpeed config from lowbit's settings: a JSON file or dict, the YAML
``deepspeed_config:`` section, and the Accelerator (batch size, accumulation, precision)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from lowbit.kernel.plugin_api import ConfigError, PrepareContext, did_you_mean

# deepspeed_config keys (YAML section, env LOWBIT_DEEPSPEED_CONFIG, launch flags) and their meaning.
SECTION_KEYS = {
    "zero_stage": "ZeRO stage: 0, 1, 2 or 3",
    "offload_optimizer_device": "none, cpu or nvme",
    "offload_param_device": "none, cpu or nvme (ZeRO-3)",
    "gradient_accumulation_steps": "micro-batches per step, or auto (the Accelerator's)",
    "gradient_clipping": "max gradient norm, or auto",
    "deepspeed_config_file": "path to a DeepSpeed JSON config",
    "config": "a DeepSpeed config dict (code or JSON env)",
}
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# DeepSpeed's own fp16 defaults: dynamic loss scaling (loss_scale 0), as in its docs' example.
FP16_DEFAULTS = {
    "enabled": True,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def check_section(options: dict[str, Any]) -> None:
    for key, value in options.items():
        if key not in SECTION_KEYS:
            raise ConfigError(
                f"Unknown key {key!r} in deepspeed_config.{did_you_mean(key, SECTION_KEYS)} Valid keys: "
                f"{', '.join(SECTION_KEYS)}."
            )
    if "zero_stage" in options and _as_int(options["zero_stage"], "zero_stage") not in ZERO_STAGES:
        raise ConfigError(f"zero_stage must be 0, 1, 2 or 3; got {options['zero_stage']!r}.")
    for key in ("offload_optimizer_device", "offload_param_device"):
        if key in options and str(options[key]).lower() not in OFFLOAD_DEVICES:
            raise ConfigError(f"{key} must be none, cpu or nvme; got {options[key]!r}.")


def _as_int(value: Any, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"deepspeed_config.{key} must be a whole number, got {value!r}.") from None


def read_json_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config file {str(path)!r} does not exist.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"DeepSpeed config file {str(path)!r} is not valid JSON, line {exc.lineno} column {exc.colno}: {exc.msg}."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config file {str(path)!r} must hold a JSON object.")
    return data


def _precision_sections(config: dict[str, Any], mixed_precision: str) -> None:
    """Fill fp16/bf16 from mixed_precision; refuse a user config that contradicts it."""

    def enabled(section: str) -> Any:
        return config.get(section, {}).get("enabled", False) if isinstance(config.get(section), dict) else False

    fp16, bf16 = enabled("fp16"), enabled("bf16")
    if fp16 is True and bf16 is True:
        raise ConfigError("The DeepSpeed config enables both fp16.enabled=true and bf16.enabled=true; enable one.")
    wanted = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}.get(mixed_precision)  # FP8 runs with bf16 in DeepSpeed
    for section, value in (("fp16", fp16), ("bf16", bf16)):
        if value is True and wanted != section:
            raise ConfigError(
                f"The DeepSpeed config sets {section}.enabled=true but mixed_precision={mixed_precision!r}"
                f"{' (which runs DeepSpeed in bf16)' if mixed_precision == 'fp8' else ''}. Make them agree, or use "
                "\"auto\"."
            )
    for section in ("fp16", "bf16"):
        if section == wanted:
            base = FP16_DEFAULTS if section == "fp16" else {"enabled": True}
            config[section] = {
                **base,
                **{k: v for k, v in config.get(section, {}).items() if v != "auto"},
                "enabled": True,
            }
        elif isinstance(config.get(section), dict):
            config[section]["enabled"] = False


def build_config(options: dict[str, Any], context: PrepareContext) -> dict[str, Any]:
    """The dict given to ``deepspeed.initialize``. Section keys override the file's values;
    "auto" values are filled from the Accelerator."""
    check_section(options)
    if isinstance(options.get("config"), dict):
        config = copy.deepcopy(options["config"])
    elif options.get("deepspeed_config_file"):
        config = read_json_config(options["deepspeed_config_file"])
    else:
        config = {}
    zero = config.setdefault("zero_optimization", {})
    if "zero_stage" in options:
        zero["stage"] = _as_int(options["zero_stage"], "zero_stage")
    zero.setdefault("stage", 0)
    for key, target in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        device = str(options.get(key, "none")).lower()
        if device != "none":
            zero[target] = {**zero.get(target, {}), "device": device}
    gas = options.get("gradient_accumulation_steps", config.get("gradient_accumulation_steps", "auto"))
    config["gradient_accumulation_steps"] = (
        context.gradient_accumulation_steps if gas == "auto" else _as_int(gas, "gradient_accumulation_steps")
    )
    clipping = options.get("gradient_clipping", config.get("gradient_clipping"))
    if clipping not in (None, "auto"):
        config["gradient_clipping"] = float(clipping)
    else:
        config.pop("gradient_clipping", None)
    micro = config.get("train_micro_batch_size_per_gpu", "auto")
    config["train_micro_batch_size_per_gpu"] = (context.batch_size or 1) if micro == "auto" else micro
    if config.get("train_batch_size", "auto") == "auto":
        config["train_batch_size"] = (
            config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * context.world_size
        )
    _precision_sections(config, context.mixed_precision)
    # lowbit may hand DeepSpeed a backend's optimizer (e.g. torchao's AdamWFp8).
    config.setdefault("zero_allow_untested_optimizer", True)
    return config
