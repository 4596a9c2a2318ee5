"""Config file, env vars, explicit arguments: parsing, validation, precedence, round trip."""

from __future__ import annotations

import pytest
import yaml
from helpers import FakeBackend, FakeRecipe, manager_with

from lowbit import Accelerator

from lowbit.kernel.errors import ConfigError
from lowbit.kernel.recipes import FP8RecipeKwargs

from lowbit.run.settings import (
    LowbitConfig,
    config_from_env,
    config_to_env,
    read_config_file,
    resolve_config,
    validate_config,
    write_config_file,
)

ACCELERATE_DOCS_TE_YAML = """\
mixed_precision: fp8
fp8_config:
  amax_compute_algo: max
  amax_history_len: 1024
  backend: TE
  fp8_format: HYBRID
  interval: 1
  margin: 0
  override_linear_precision: (false, false, false)
  use_autocast_during_eval: false
"""


def test_accelerate_docs_yaml_parses_override_linear_precision_as_three_bools(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(ACCELERATE_DOCS_TE_YAML)
    config = resolve_config(config_file=path, environ={})
    assert config.fp8_config["override_linear_precision"] == (False, False, False)
    assert config.fp8_config["backend"] == "te"  # Accelerate spells it TE; lowbit names plugins in lower case
    assert config.mixed_precision == "fp8"


def test_msamp_docs_yaml_and_optimization_level_synonym():
    config = validate_config({"mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP", "optimization_level": "O2"}})
    assert config.fp8_config == {"backend": "MSAMP", "opt_level": "O2"}


def test_unknown_fp8_key_suggests_the_nearest_one():
    with pytest.raises(ConfigError, match=r"amax_history_length.*Did you mean 'amax_history_len'"):
        validate_config({"fp8_config": {"amax_history_length": 16}})


def test_key_in_the_wrong_place_says_where_it_belongs():
    with pytest.raises(ConfigError, match=r"belongs inside fp8_config"):
        validate_config({"amax_history_len": 16})
    with pytest.raises(ConfigError, match=r"top-level key"):
        validate_config({"fp8_config": {"mixed_precision": "fp8"}})


def test_unknown_top_level_key_suggests():
    with pytest.raises(ConfigError, match=r"Did you mean 'mixed_precision'"):
        validate_config({"mixed_precison": "bf16"})


def test_wrong_type_names_key_and_value(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: two\n")
    with pytest.raises(ConfigError, match=r"num_processes.*expects int.*'two'"):
        resolve_config(config_file=path, environ={})


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mixed_precision: fp8\nfp8_config: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*not valid YAML, line 3"):
        read_config_file(path)


def test_yaml_is_read_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("mixed_precision: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_config_file(path)


def test_unknown_precision_is_refused_with_suggestion():
    with pytest.raises(ConfigError, match=r"'fp9'.*Did you mean 'fp8'"):
        Accelerator(mixed_precision="fp9")


def test_precedence_explicit_over_env_over_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: bf16\ngradient_accumulation_steps: 4\ndynamo_backend: eager\n")
    env = {"LOWBIT_MIXED_PRECISION": "fp16", "LOWBIT_GRADIENT_ACCUMULATION_STEPS": "2"}
    config = resolve_config({"gradient_accumulation_steps": 3}, config_file=path, environ=env)
    assert config.mixed_precision == "fp16"  # env beats file
    assert config.gradient_accumulation_steps == 3  # explicit beats env
    assert config.dynamo_backend == "eager"  # file beats default
    assert resolve_config(environ={}).mixed_precision == "no"  # default


def test_default_config_path_is_used_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    write_config_file(LowbitConfig(mixed_precision="bf16"), tmp_path / "lowbit" / "default_config.yaml")
    assert resolve_config(environ={}).mixed_precision == "bf16"


def test_file_env_round_trip(tmp_path):
    original = LowbitConfig(
        mixed_precision="fp8",
        num_processes=2,
        use_cpu=True,
        gradient_accumulation_steps=2,
        fp8_config={"backend": "te", "amax_history_len": 16, "override_linear_precision": (True, False, False)},
        sections={"deepspeed_config": {"zero_stage": 2}},
    )
    path = write_config_file(original, tmp_path / "c.yaml")
    from_file = resolve_config(config_file=path, environ={})
    assert from_file == original
    from_env = validate_config(config_from_env(config_to_env(from_file)))
    assert from_env == original


def test_env_values_are_checked_and_named():
    with pytest.raises(ConfigError, match=r"environment variable LOWBIT_"):
        resolve_config(environ={"LOWBIT_NUM_PROCESSES": "many"})


def test_recipe_fields_fill_from_env_and_explicit_wins(monkeypatch):
    monkeypatch.setenv("LOWBIT_FP8_MARGIN", "3")
    monkeypatch.setenv("LOWBIT_FP8_FORMAT", "e4m3")
    recipe = FakeRecipe(margin=1)
    assert recipe.margin == 1 and recipe.fp8_format == "E4M3"


def test_recipe_precedence_env_over_file_over_default(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: fp8\nfp8_config:\n  margin: 5\n  fp8_format: E5M2\n")
    monkeypatch.setenv("LOWBIT_FP8_FORMAT", "E4M3")
    backend = FakeBackend("fake", 100, options_class=FakeRecipe)
    acc = Accelerator(config_file=path, plugin_manager=manager_with(backend))
    assert acc.fp8_options.margin == 5 and acc.fp8_options.fp8_format == "E4M3"
    acc = Accelerator(config_file=path, plugin_manager=manager_with(backend), kwargs_handlers=[FakeRecipe(margin=7)])
    assert acc.fp8_options.margin == 7


def test_fp8_recipe_kwargs_options_reach_the_backend_and_typos_are_caught():
    backend = FakeBackend("fake", 100, options_class=FakeRecipe)
    acc = Accelerator(
        mixed_precision="fp8",
        kwarg_handlers=[FP8RecipeKwargs(backend="fake", margin=2)],
        plugin_manager=manager_with(backend),
    )
    assert acc.fp8_options.margin == 2
    with pytest.raises(ConfigError, match=r"'margn'.*Did you mean 'margin'"):
        Accelerator(
            mixed_precision="fp8",
            kwargs_handlers=[FP8RecipeKwargs(backend="fake", margn=2)],
            plugin_manager=manager_with(backend),
        )


def test_plugin_options_are_valid_config_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: fp8\nfp8_config:\n  fp8_format: E9M9\n")
    backend = FakeBackend("fake", 100, options_class=FakeRecipe)
    with pytest.raises(ConfigError, match=r"E9M9.*Valid: E4M3, E5M2, HYBRID"):
        Accelerator(config_file=path, plugin_manager=manager_with(backend))


def test_written_yaml_is_plain(tmp_path):
    path = write_config_file(
        LowbitConfig(fp8_config={"override_linear_precision": (False, True, False)}), tmp_path / "c.yaml"
    )
    assert yaml.safe_load(path.read_text())["fp8_config"]["override_linear_precision"] == [False, True, False]


def test_an_accelerator_validates_each_settings_layer_once(monkeypatch):
    """File, ACCELERATE_*, LOWBIT_* and arguments: each layer's keys parsed once, the merge not again
    (it was ten validations per Accelerator: two passes of four layers and their merge)."""
    from lowbit.run import settings

    layers = []
    parse = settings._parse_layer
    monkeypatch.setattr(settings, "_parse_layer", lambda raw, *a, **k: layers.append(k) or parse(raw, *a, **k))
    monkeypatch.setattr(settings, "validate_config", lambda *a, **k: pytest.fail("the merged settings validated again"))
    monkeypatch.setenv("LOWBIT_GRADIENT_ACCUMULATION_STEPS", "2")
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    assert accelerator.config.gradient_accumulation_steps == 2
    assert len(layers) == 4
