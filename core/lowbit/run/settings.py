"""The lowbit settings: YAML file, env vars and explicit arguments merged into one validated object.

Precedence, highest first: explicit argument > CLI flag / env var > config file > default.
``lowbit launch`` turns CLI flags and the config file into env vars for the training processes,
so a script run by hand and a script run by the launcher resolve settings the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from lowbit.kernel import notices
from lowbit.kernel.env_numbers import SIMULATE_NCCL_ENV as SIMULATE_ENV
from lowbit.kernel.errors import ConfigError, did_you_mean
from lowbit.kernel.first_party import FIRST_PARTY_SECTIONS, install_command
from lowbit.kernel.options import OptionSpec, at_least, to_text
from lowbit.kernel.recipes import DOCUMENTED_FP8_KEYS, OPTION_SYNONYMS, fp8_env_var
from lowbit.kernel.types import NATIVE_PRECISIONS

from lowbit.runtime.atomic_write import write_atomically

from lowbit.run.accelerate_config import WHERE_ENV as ACCELERATE_ENV
from lowbit.run.accelerate_config import settings_from_accelerate_env, translate_config_file

CONFIG_FILE_ENV = "LOWBIT_CONFIG_FILE"
# distributed_type values that need no strategy on one process (Accelerate's names for plain data parallel).
SINGLE_PROCESS_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")
FP8_SECTION = "fp8_config"
# The run's parallel layout (lowbit.run.layout reads and checks it when the run is built).
PARALLELISM_SECTION = "parallelism_config"
# Strategy sections (``fsdp_config``, ...) are named by the strategies themselves
# (StrategyDescription.config_section); before the plugins are known, any ``*_config`` mapping passes.
SECTION_SUFFIX = "_config"
MAX_CONFIG_BYTES = 1 << 20
# LOWBIT_* variables read outside this module (plugin manager, launcher).
# Set by lowbit launch for its ranks: the settings that came from the config file -> where.
SOURCES_ENV = "LOWBIT_SETTING_SOURCES"
# "0": lowbit launch starts a script directly, without lowbit.patch_trainer (lowbit.cli.run_script).
PATCH_ENV = "LOWBIT_PATCH_TRAINER"
OTHER_ENV_VARS = frozenset(
    {
        CONFIG_FILE_ENV,
        "LOWBIT_PLUGINS",
        "LOWBIT_STRICT_PLUGINS",
        "LOWBIT_LOG_LEVEL",
        "LOWBIT_SAID_NOTES",
        "LOWBIT_ARRIVAL_TIMEOUT",
        "LOWBIT_THROUGHPUT",
        "LOWBIT_THROUGHPUT_EVERY",
        SIMULATE_ENV,
        "LOWBIT_PREEMPTION_GRACE",
        "LOWBIT_PREEMPTION_WARNING",
        "LOWBIT_PREEMPTION_POLL_STEPS",
        SOURCES_ENV,
        PATCH_ENV,
    }
)


def env_source(env_var: str, default: str) -> str:
    """Where the value of ``env_var`` came from: the config file and key when lowbit launch
    exported it from there (``LOWBIT_SETTING_SOURCES``), else ``default``."""
    try:
        sources = json.loads(os.environ.get(SOURCES_ENV) or "{}")
    except json.JSONDecodeError:
        return default
    return sources.get(env_var, default) if isinstance(sources, dict) else default


_warned_env_vars: set[str] = set()


def _spec(
    name: str,
    kind: Any,
    default: Any = None,
    choices: tuple[str, ...] | None = None,
    help: str = "",
    normalize: Any = None,
) -> OptionSpec:
    return OptionSpec(name, kind, default, choices, help, env="LOWBIT_" + name.upper(), normalize=normalize)


# Other spellings of a precision people type (torch's dtype names, "fp32" for full precision).
PRECISION_ALIASES = {
    "fp32": "no",
    "float32": "no",
    "float": "no",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
}


def normalize_precision(value: Any) -> Any:
    """``mixed_precision`` in lower case, with its aliases (``fp32`` is ``no``, ``bfloat16`` is ``bf16``)."""
    text = str(value).strip().lower()
    return PRECISION_ALIASES.get(text, text)


def _setting(kind: Any, default: Any, help: str, choices: tuple[str, ...] | None = None, normalize: Any = None) -> Any:
    """A top-level setting: a LowbitConfig field whose metadata is its option spec (type, choices,
    help, ``LOWBIT_<NAME>`` env var), so each setting is declared once."""
    return dataclasses.field(
        default=default, metadata={"lowbit": dict(kind=kind, choices=choices, help=help, normalize=normalize)}
    )


@dataclasses.dataclass(frozen=True)
class LowbitConfig:
    mixed_precision: str = _setting(
        str, "no", "no (or fp32), fp16, bf16, or a low-precision backend's (fp8, ...)", normalize=normalize_precision
    )
    distributed_type: str = _setting(
        str, "NO", "NO, MULTI_CPU, MULTI_GPU, or the name of a strategy (`lowbit plugins`)"
    )
    num_processes: int = _setting(int, 1, "processes in all, across every machine (as in Accelerate)")
    num_machines: int = _setting(int, 1, "machines (nodes) in the job")
    machine_rank: int = _setting(int, 0, "rank of this machine, 0 for the main one")
    main_process_ip: str | None = _setting(str, None, "address of machine 0")
    main_process_port: int | None = _setting(int, None, "port of the rendezvous on machine 0")
    rdzv_backend: str = _setting(
        str,
        "static",
        "how the machines of a multi-machine job meet (torchrun's rendezvous): static, each given its "
        "machine_rank; or c10d / etcd / etcd-v2, which number the machines themselves",
        ("static", "c10d", "etcd", "etcd-v2"),
    )
    gpu_ids: str | None = _setting(
        str,
        None,
        "the GPUs to use, e.g. 0,2, or all (CUDA_VISIBLE_DEVICES for every process); "
        "without num_processes, one process each",
    )
    use_cpu: bool = _setting(bool, False, "train on CPU even when a GPU is present")
    gradient_accumulation_steps: int = _setting(int, 1, "micro-batches per optimizer step", normalize=at_least(1))
    dynamo_backend: str = _setting(str, "no", "torch.compile backend, e.g. inductor; 'no' disables")
    dynamo_mode: str | None = _setting(str, None, "torch.compile mode, e.g. default, reduce-overhead, max-autotune")
    dynamo_use_fullgraph: bool | None = _setting(bool, None, "torch.compile fullgraph: fail on graph breaks")
    dynamo_use_dynamic: bool | None = _setting(bool, None, "torch.compile dynamic shapes")
    dynamo_use_regional_compilation: bool | None = _setting(
        bool, None, "compile each repeated block (the items of the model's ModuleLists) instead of the whole model"
    )
    fp8_fallback: str | None = _setting(
        str, None, "precision to fall back to when FP8 cannot run", tuple(sorted(NATIVE_PRECISIONS))
    )
    debug: bool = _setting(bool, False, "print the launcher's underlying command")
    on_nonfinite_loss: str = _setting(
        str,
        "skip",
        "a NaN/inf loss or gradient: skip that optimizer step (with a warning "
        "naming it; one host read per step), raise, or continue (Accelerate's behaviour: no check, no host "
        "read)",
        ("skip", "raise", "continue"),
    )
    fp8_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The strategies' sections, by their YAML key ("fsdp_config": {...}); ``config.fsdp_config``
    # reads one (empty when absent).
    sections: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        if name.endswith(SECTION_SUFFIX) and not name.startswith("_"):
            return self.__dict__.get("sections", {}).get(name, {})
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    def section(self, name: str) -> dict[str, Any]:
        return self.sections.get(name, {}) if name else {}

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(data.pop("sections"))
        return {k: v for k, v in data.items() if v is not None and v != {}}


# The top-level settings' option specs, read from LowbitConfig's fields.
TOP_LEVEL: dict[str, OptionSpec] = {
    f.name: _spec(
        f.name,
        f.metadata["lowbit"]["kind"],
        f.default,
        f.metadata["lowbit"]["choices"],
        f.metadata["lowbit"]["help"],
        normalize=f.metadata["lowbit"]["normalize"],
    )
    for f in dataclasses.fields(LowbitConfig)
    if "lowbit" in f.metadata
}


def default_config_path() -> Path:
    if os.environ.get(CONFIG_FILE_ENV):
        return Path(os.environ[CONFIG_FILE_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "lowbit" / "default_config.yaml"


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (plain YAML keeps the last,
    so one of the two settings would be dropped without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config with ``yaml.safe_load``; errors name the file and the line."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise ConfigError(f"Config file {str(path)!r} is a directory; give the path of a YAML file.")
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"Config file {str(path)!r} is {size / 2**20:.1f} MiB; a config is a few hundred bytes of YAML "
                "and files "
                f"over {MAX_CONFIG_BYTES // 2**20} MiB are refused. Is it the right file?"
            )
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"Config file {str(path)!r} does not exist. Write one with `lowbit config`.") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"Config file {str(path)!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}). "
            "A config file is YAML text: save it as UTF-8."
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"Config file {str(path)!r} is not valid YAML{where}: {problem}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(path)!r} must hold a mapping of keys, got {type(data).__name__}.")
    return translate_config_file(data, where=f"Config file {str(path)!r}")


def is_section(key: str, sections: tuple[str, ...] | None) -> bool:
    """Whether ``key`` is a config section: fp8_config, or a strategy's (any ``*_config`` while the
    installed strategies are not known yet)."""
    if key in (FP8_SECTION, PARALLELISM_SECTION):
        return True
    return key in sections if sections is not None else key.endswith(SECTION_SUFFIX)


def _unknown_key_error(
    key: str, where: str, sections: tuple[str, ...] | None, fp8_keys: Mapping[str, Any]
) -> ConfigError:
    owner = FIRST_PARTY_SECTIONS.get(key)
    if owner and sections is not None:
        return ConfigError(
            f"{key} in {where} is the section of the {owner!r} strategy, whose plugin is not installed here. "
            f"Install it: {install_command(owner)}."
        )
    inside = " It belongs inside fp8_config." if key in fp8_keys else ""
    known = list(TOP_LEVEL) + [FP8_SECTION] + list(sections or ())
    return ConfigError(f"Unknown key {key!r} in {where}.{did_you_mean(key, known)}{inside}")


def _section_error(section: str, key: str, valid: Mapping[str, Any]) -> ConfigError:
    top_hint = " It is a top-level key: move it out of the section." if key in TOP_LEVEL else ""
    # A backend's own keys are known only when its plugin is installed (its options class says them).
    plugin_hint = (
        " If it is an option of a backend whose plugin is not installed here, install that plugin "
        "(`lowbit plugins` lists the installed ones)."
        if section == FP8_SECTION and not top_hint
        else ""
    )
    return ConfigError(
        f"Unknown key {key!r} in {section}.{did_you_mean(key, valid)}{top_hint}{plugin_hint} "
        f"Valid keys: {', '.join(sorted(valid))}."
    )


def validate_config(
    raw: Mapping[str, Any],
    fp8_specs: Mapping[str, OptionSpec] | None = None,
    where: str = "config",
    *,
    check_fp8_keys: bool = True,
    sections: tuple[str, ...] | None = None,
) -> LowbitConfig:
    """Check every key and type; unknown or misplaced keys get a 'did you mean' error.

    ``fp8_specs`` adds the installed plugins' fp8_config keys to the documented ones.
    ``check_fp8_keys=False`` skips fp8_config (used before the plugins are known).
    ``sections``: the installed strategies' sections; None accepts any ``*_config`` mapping.
    """
    return _config_from(_parse_layer(raw, fp8_specs, where, check_fp8_keys=check_fp8_keys, sections=sections))


ENV_LAYER = "environment variables"


def _parse_layer(
    raw: Mapping[str, Any],
    fp8_specs: Mapping[str, OptionSpec] | None,
    where: str,
    *,
    check_fp8_keys: bool,
    sections: tuple[str, ...] | None,
) -> dict[str, Any]:
    """One layer's keys parsed (errors name the layer); sections stay keyed by their name."""
    fp8_specs = dict(DOCUMENTED_FP8_KEYS, **(fp8_specs or {}))
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if is_section(key, sections):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{key} in {where} must be a mapping (a YAML section), got {value!r}.")
            checked = key == FP8_SECTION and check_fp8_keys
            values[key] = _validate_section(key, value, fp8_specs, where) if checked else dict(value)
            continue
        if key not in TOP_LEVEL:
            raise _unknown_key_error(key, where, sections, fp8_specs)
        spec = TOP_LEVEL[key]
        # From the environment, the variable itself is named (LOWBIT_GRADIENT_ACCUMULATION_STEPS=-3).
        values[key] = spec.parse(value, where=f"environment variable {spec.env}" if where == ENV_LAYER else where)
    return values


def _config_from(values: Mapping[str, Any]) -> LowbitConfig:
    top = {key: value for key, value in values.items() if key in TOP_LEVEL or key == FP8_SECTION}
    return LowbitConfig(**top, sections={key: value for key, value in values.items() if key not in top})


def check_plugin_names(config: LowbitConfig, precisions: list[str], distributed_types: list[str], where: str) -> None:
    """``mixed_precision`` and ``distributed_type``, which plugins define, against the installed ones
    (plus the names of Accelerate's that lowbit's first-party plugins serve, so that a missing one
    gets its install command when it is chosen rather than 'unknown')."""
    known_precisions = sorted(NATIVE_PRECISIONS) + [p for p in [*precisions, "fp8"] if p not in NATIVE_PRECISIONS]
    if config.mixed_precision not in known_precisions:
        raise ConfigError(
            f"mixed_precision {config.mixed_precision!r} (from {where}) is not a precision lowbit or an "
            f"installed backend offers.{did_you_mean(config.mixed_precision, known_precisions)} "
            f"Known here: {', '.join(dict.fromkeys(known_precisions))}."
        )
    known_types = list(dict.fromkeys([*SINGLE_PROCESS_TYPES, *distributed_types, *FIRST_PARTY_SECTIONS.values()]))
    if config.distributed_type.upper() not in {t.upper() for t in known_types}:
        raise ConfigError(
            f"distributed_type {config.distributed_type!r} (from {where}) names no installed strategy."
            f"{did_you_mean(config.distributed_type, known_types)} Known here: {', '.join(known_types)} "
            "(`lowbit plugins` lists the strategies)."
        )


def _validate_section(
    section: str, data: Mapping[str, Any], specs: Mapping[str, OptionSpec], where: str
) -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        real = OPTION_SYNONYMS.get(key, key)
        if real not in specs:
            raise _section_error(section, key, specs)
        out[real] = specs[real].parse(value, where=f"{where}, {section}.{key}")
    return out


def config_from_env(environ: Mapping[str, str], fp8_specs: Mapping[str, OptionSpec] | None = None) -> dict[str, Any]:
    """The settings present in env vars, as raw config keys (same shape as the YAML file)."""
    raw: dict[str, Any] = {}
    for key, spec in TOP_LEVEL.items():
        if environ.get(spec.env, "") != "":
            raw[key] = environ[spec.env]
    fp8 = {}
    for key in dict(DOCUMENTED_FP8_KEYS, **(fp8_specs or {})):
        env = fp8_env_var(key)
        if environ.get(env, "") != "":
            fp8[key] = environ[env]
    if fp8:
        raw["fp8_config"] = fp8
    for env, value in environ.items():
        if (
            env.startswith("LOWBIT_")
            and env.endswith(SECTION_SUFFIX.upper())
            and env != fp8_env_var("config")
            and value
        ):
            section = env[len("LOWBIT_") :].lower()
            try:
                raw[section] = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"Env var {env} must hold JSON: {exc}.") from None
    return raw


@dataclasses.dataclass(frozen=True)
class LauncherSettings:
    """The settings only ``lowbit launch`` reads: how many processes, on how many machines, meeting
    where and how, on which GPUs, and whether to print its command. Named as everywhere else (YAML
    keys, ``LOWBIT_*`` variables and flags are :data:`TOP_LEVEL`'s). A rank learns its place from
    torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``), so none of these is exported to it."""

    num_processes: int
    num_machines: int
    machine_rank: int
    main_process_ip: str | None
    main_process_port: int | None
    rdzv_backend: str
    gpu_ids: str | None
    debug: bool

    @classmethod
    def of(cls, config: LowbitConfig) -> LauncherSettings:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def run_settings_env(config: LowbitConfig) -> dict[str, str]:
    """What the launcher exports to the ranks: ``config_to_env`` without the launcher's own settings."""
    launcher_only = {TOP_LEVEL[f.name].env for f in dataclasses.fields(LauncherSettings)}
    return {key: value for key, value in config_to_env(config).items() if key not in launcher_only}


def section_env_var(section: str) -> str:
    """``fsdp_config`` -> ``LOWBIT_FSDP_CONFIG`` (its content as JSON)."""
    return "LOWBIT_" + section.upper()


def config_to_env(config: LowbitConfig) -> dict[str, str]:
    """The inverse of ``config_from_env``: what the launcher exports to training processes."""
    env = {}
    for key, spec in TOP_LEVEL.items():
        value = getattr(config, key)
        if value is not None and value != spec.default:
            env[spec.env] = to_text(value)
    for key, value in config.fp8_config.items():
        if value is not None:
            env[fp8_env_var(key)] = to_text(value)
    for section, content in config.sections.items():
        if content:
            env[section_env_var(section)] = json.dumps(content)
    return env


def merge_raw(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Merge raw config layers, later ones winning; sections merge key by key."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key.endswith(SECTION_SUFFIX) and isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return merged


def read_config_layer(config_file: str | os.PathLike | None) -> tuple[dict[str, Any], str]:
    """The config file's raw keys and its path: the given file, else the default one if present."""
    if config_file is not None:
        return read_config_file(config_file), str(config_file)
    path = default_config_path()
    return (read_config_file(path) if path.exists() else {}), str(path)


def warn_unknown_env_vars(
    environ: Mapping[str, str],
    fp8_specs: Mapping[str, OptionSpec] | None = None,
    sections: tuple[str, ...] | None = None,
) -> None:
    """A LOWBIT_* variable lowbit does not read is most likely a typo: say so, once per name."""
    known = {spec.env for spec in TOP_LEVEL.values()} | set(OTHER_ENV_VARS)
    known |= {section_env_var(section) for section in (*(sections or ()), PARALLELISM_SECTION)}
    fp8_keys = set(DOCUMENTED_FP8_KEYS) | set(fp8_specs or {})
    known |= {fp8_env_var(key) for key in fp8_keys}
    for name in sorted(environ):
        if name.startswith("LOWBIT_") and name not in known and name not in _warned_env_vars:
            _warned_env_vars.add(name)
            notices.warn(
                f"Environment variable {name} is read by neither lowbit nor an installed plugin, and is ignored."
                f"{did_you_mean(name, known)}"
            )


def setting_layers(
    explicit: Mapping[str, Any] | None,
    environ: Mapping[str, str],
    file_layer: tuple[dict[str, Any], str],
    fp8_specs: Mapping[str, OptionSpec] | None = None,
) -> list[tuple[dict[str, Any], str]]:
    """The raw settings and where each came from, lowest precedence first: config file < ACCELERATE_*
    env vars < LOWBIT_* env vars < explicit arguments. (``accelerate launch`` exports its config file as
    ACCELERATE_* variables.)"""
    return [
        file_layer,
        (settings_from_accelerate_env(environ), ACCELERATE_ENV),
        (config_from_env(environ, fp8_specs), ENV_LAYER),
        ({k: v for k, v in (explicit or {}).items() if v is not None}, "arguments in the code"),
    ]


def setting_before_plugins(
    name: str,
    explicit: Mapping[str, Any] | None,
    file_layer: tuple[dict[str, Any], str],
    environ: Mapping[str, str] | None = None,
) -> Any:
    """One top-level setting, read before the plugins are loaded (hardware detection needs ``use_cpu``);
    the whole config is validated once the plugins' keys are known."""
    for raw, where in reversed(setting_layers(explicit, os.environ if environ is None else environ, file_layer)):
        if raw.get(name) is not None:
            return TOP_LEVEL[name].parse(raw[name], where=where)
    return TOP_LEVEL[name].default


def resolve_config(
    explicit: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
    fp8_specs: Mapping[str, OptionSpec] | None = None,
    *,
    check_fp8_keys: bool = True,
    file_layer: tuple[dict[str, Any], str] | None = None,
    sections: tuple[str, ...] | None = None,
) -> LowbitConfig:
    """Merge default < the layers of :func:`setting_layers`, each validated once (errors name its source).

    ``file_layer`` is the config file already read by :func:`read_config_layer` (read it once).
    ``sections``: the installed strategies' config sections (None: not known yet)."""
    environ = os.environ if environ is None else environ
    file_layer = file_layer if file_layer is not None else read_config_layer(config_file)
    if check_fp8_keys:
        warn_unknown_env_vars(environ, fp8_specs, sections)
    parsed = [
        _parse_layer(raw, fp8_specs, where, check_fp8_keys=check_fp8_keys, sections=sections)
        for raw, where in setting_layers(explicit, environ, file_layer, fp8_specs)
    ]
    return _config_from(merge_raw(*parsed))


def write_config_file(config: LowbitConfig, path: str | os.PathLike) -> Path:
    """Write atomically: a crash mid-write leaves the previous file in place."""
    data = config.to_dict()
    if "fp8_config" in data and "override_linear_precision" in data["fp8_config"]:
        data["fp8_config"]["override_linear_precision"] = list(data["fp8_config"]["override_linear_precision"])
    return write_atomically(path, lambda handle: handle.write(yaml.safe_dump(data, sort_keys=True).encode()))


def precision_asked_outside(
    file_layer: tuple[dict[str, Any], str], environ: Mapping[str, str]
) -> tuple[str | None, str]:
    """The ``mixed_precision`` the launcher, the environment or the config file asked for (not an
    argument), and where it came from; (None, "") when none did."""
    for raw, where in reversed(setting_layers(None, environ, file_layer)):
        if raw.get("mixed_precision") is not None:
            value = normalize_precision(str(raw["mixed_precision"]).lower())
            if where == ENV_LAYER:  # lowbit launch passes its flags and config file this way
                where = "LOWBIT_MIXED_PRECISION (lowbit launch --mixed_precision or its config file)"
            return value, where
    return None, ""


def precision_under_front(front: str, asked: str | None, where: str, front_name: str) -> tuple[str, str | None]:
    """The precision to train in, from a front's default (transformers' Trainer passes its
    TrainingArguments' every time) and the one asked outside the script, and what to tell the user
    when the asked one overrides the front's (None: nothing to say). The front's "no" is its
    default and yields; FP8 or FP4 asked wins over the front's bf16 (its layers outside the backend
    run in bf16 autocast anyway); any other disagreement is an error naming both."""
    if asked is None or asked == front:
        return front, None
    if front == "no":  # the front's default: the launcher's choice stands
        return asked, None
    if asked == "no":  # the launcher left it at fp32; the script's own choice stands
        return front, None
    if asked in ("fp8", "fp4") and front == "bf16":
        return asked, (
            f"mixed_precision={asked!r} from {where} wins over {front_name}'s bf16: the layers the backend converts "
            f"train in {asked}, the rest in bf16 autocast, as any {asked} run does."
        )
    raise ConfigError(
        f"{front_name} asks for mixed_precision={front!r} and {where} asks for {asked!r}. Say one: drop "
        f"--mixed_precision (or the config's mixed_precision) to keep {front_name}'s, or set "
        f"{'fp16' if front == 'fp16' else 'bf16'}=False there to use {asked!r}."
    )
