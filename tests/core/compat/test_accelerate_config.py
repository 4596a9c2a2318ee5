"""Accelerate's config files, launcher flags and ACCELERATE_* variables reach lowbit's settings."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import TESTS, said

from lowbit.kernel.errors import ConfigError

from lowbit.run.settings import read_config_file, resolve_config, validate_config


def config_from(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return validate_config(read_config_file(path), where=str(path))


def test_a_file_written_by_accelerate_config_loads(tmp_path, recwarn):
    """Written by Accelerate's own config writer, with the keys `accelerate config` asks about."""
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    path = tmp_path / "default_config.yaml"
    config_args.ClusterConfig(
        compute_environment="LOCAL_MACHINE",
        distributed_type="MULTI_CPU",
        mixed_precision="bf16",
        use_cpu=True,
        debug=False,
        num_processes=4,
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=29511,
        dynamo_config={
            "dynamo_backend": "INDUCTOR",
            "dynamo_mode": "max-autotune",
            "dynamo_use_fullgraph": True,
            "dynamo_use_regional_compilation": True,
        },
    ).to_yaml_file(path)
    config = validate_config(read_config_file(path))
    assert (config.mixed_precision, config.distributed_type, config.num_processes, config.num_machines) == (
        "bf16",
        "MULTI_CPU",
        4,
        2,
    )
    assert (config.dynamo_backend, config.dynamo_mode, config.dynamo_use_fullgraph) == (
        "inductor",
        "max-autotune",
        True,
    )
    assert config.dynamo_use_regional_compilation is True  # it was ignored with a note
    assert config.rdzv_backend == "static"  # read: a c10d rendezvous reaches torchrun (docs/cluster.md)
    note = said(recwarn)
    assert "lowbit: note: " in note and "no effect in lowbit" in note and "compute_environment" in note
    assert "rdzv_backend" not in note


def test_unquoted_no_means_no(tmp_path):
    config = config_from(
        tmp_path,
        """
        mixed_precision: no
        distributed_type: NO
        dynamo_config:
          dynamo_backend: NO
    """,
    )
    assert (config.mixed_precision, config.distributed_type, config.dynamo_backend) == ("no", "NO", "no")


def test_fsdp_section_with_accelerate_key_names(tmp_path, recwarn):
    config = config_from(
        tmp_path,
        """
        distributed_type: FSDP
        fsdp_config:
          fsdp_sharding_strategy: SHARD_GRAD_OP
          fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer, LlamaMLP
          fsdp_offload_params: false
          fsdp_use_orig_params: true
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
    """,
    )
    assert config.fsdp_config == {
        "reshard_after_forward": False,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "LlamaMLP"],
    }
    assert "fsdp_use_orig_params" in said(recwarn)


@pytest.mark.parametrize(
    "line, message",
    [
        ("  fsdp_offload_params: true", "parameter offload"),
        ("  fsdp_sharding_strategy: HYBRID_SHARD", "parallelism_config"),
    ],
)
def test_fsdp_features_lowbit_lacks_are_errors(tmp_path, line, message):
    with pytest.raises(ConfigError, match=message):
        config_from(tmp_path, "distributed_type: FSDP\nfsdp_config:\n" + line + "\n")


def test_activation_checkpointing_and_the_parallel_layout_are_read(tmp_path):
    """Accelerate's tp_hsdp.yaml / cp.yaml shape: the layout loses its key prefix; FSDP's
    activation checkpointing becomes the strategy's option."""
    config = config_from(
        tmp_path,
        """
        distributed_type: FSDP
        fsdp_config:
          fsdp_activation_checkpointing: true
        parallelism_config:
          parallelism_config_cp_size: 1
          parallelism_config_dp_replicate_size: 2
          parallelism_config_dp_shard_size: 2
          parallelism_config_tp_size: 2
    """,
    )
    assert config.fsdp_config == {"activation_checkpointing": True}
    assert config.section("parallelism_config") == {
        "cp_size": 1,
        "dp_replicate_size": 2,
        "dp_shard_size": 2,
        "tp_size": 2,
    }


def test_deepspeed_and_fp8_sections(tmp_path):
    config = config_from(
        tmp_path,
        """
        distributed_type: DEEPSPEED
        mixed_precision: fp8
        deepspeed_config:
          zero_stage: 2
          zero3_init_flag: false
          offload_optimizer_device: none
        fp8_config:
          backend: MS-AMP
          opt_level: O2
    """,
    )
    assert config.deepspeed_config == {"zero_stage": 2, "offload_optimizer_device": "none"}
    assert config.fp8_config == {"backend": "msamp", "opt_level": "O2"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("distributed_type: MULTI_XPU", "not supported by lowbit"),
        ("distributed_type: XLA", "TPUs"),
        ("num_processes: -1", "total number of processes"),
    ],
)
def test_what_lowbit_cannot_do_is_an_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        config_from(tmp_path, text)


# ------------------------------------------------------------------ ACCELERATE_* variables


def test_accelerate_launch_variables_become_settings():
    environ = {
        "ACCELERATE_MIXED_PRECISION": "fp8",
        "ACCELERATE_FP8_BACKEND": "AO",
        "ACCELERATE_FP8_PAD_INNER_DIM": "true",
        "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "true",
        "ACCELERATE_FP8_FORMAT": "HYBRID",
        "ACCELERATE_FP8_MARGIN": "0",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
    }
    config = resolve_config(environ=environ, config_file=os.devnull, check_fp8_keys=False)
    assert (config.mixed_precision, config.gradient_accumulation_steps, config.dynamo_backend) == ("fp8", 4, "no")
    # TE's keys, exported with their defaults by the launcher, are not handed to the ao backend.
    assert config.fp8_config == {"backend": "ao", "pad_inner_dim": "true", "enable_fsdp_float8_all_gather": "true"}


def test_te_options_from_the_launcher_and_lowbit_variables_win():
    environ = {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "LOWBIT_MIXED_PRECISION": "fp16",
        "ACCELERATE_FP8_BACKEND": "TE",
        "ACCELERATE_FP8_OVERRIDE_WGRAD": "True",
        "ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING": "true",
    }
    config = resolve_config(environ=environ, config_file=os.devnull, check_fp8_keys=False)
    assert config.mixed_precision == "fp16"
    assert config.fp8_config == {
        "backend": "te",
        "override_linear_precision": ["false", "false", "True"],
        "recipe": "mxfp8",
    }


def test_fsdp_and_deepspeed_from_the_launcher():
    fsdp = resolve_config(
        environ={
            "ACCELERATE_USE_FSDP": "true",
            "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
            "FSDP_RESHARD_AFTER_FORWARD": "false",
            "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
            "FSDP_OFFLOAD_PARAMS": "false",
            "FSDP_USE_ORIG_PARAMS": "true",
        },
        config_file=os.devnull,
    )
    assert fsdp.distributed_type == "FSDP"
    assert fsdp.fsdp_config == {"reshard_after_forward": False, "transformer_layer_cls_to_wrap": ["Block"]}
    ds = resolve_config(
        environ={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, config_file=os.devnull
    )
    assert ds.distributed_type == "DEEPSPEED" and ds.deepspeed_config == {"zero_stage": "3"}
    with pytest.raises(ConfigError, match="parameter offload"):
        resolve_config(environ={"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"}, config_file=os.devnull)


SHOW_SETTINGS = TESTS / "scripts" / "show_settings.py"


@pytest.mark.multiprocess
def test_a_script_started_by_accelerate_launch_keeps_fp8(tmp_path):
    """The launcher sets ACCELERATE_* variables only; FP8 must not be silently lost."""
    pytest.importorskip("accelerate")
    pytest.importorskip("lowbit_ao")
    script = SHOW_SETTINGS
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HOME=str(tmp_path / "hf"))
    # --multi_gpu is how `accelerate launch` starts several processes through torchrun.
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "fp8",
        "--fp8_backend",
        "ao",
        "--dynamo_backend",
        "no",
        str(script),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line.split()[1:6] for line in proc.stdout.splitlines() if line.startswith("SETTINGS"))
    assert lines == [["0", "2", "fp8", "ao", "ddp"], ["1", "2", "fp8", "ao", "ddp"]]


# ------------------------------------------------------------------ lowbit launch flags


def build(tmp_path, monkeypatch, *flags):
    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    monkeypatch.setenv("LOWBIT_CONFIG_FILE", os.devnull)
    args = build_parser().parse_args(["launch", *flags, str(script) if "-m" not in flags else "pkg.train"])
    return build_command(args)


def test_accelerate_launcher_flags(tmp_path, monkeypatch, recwarn):
    command, env, config = build(
        tmp_path,
        monkeypatch,
        "--multi_gpu",
        "--num_processes",
        "2",
        "--monitor_interval",
        "2",
        "--num_cpu_threads_per_process",
        "3",
        "--gpu_ids",
        "all",
        "--same_network",
        "-m",
    )
    assert command[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    assert "--monitor_interval=2.0" in command and "--module" in command and command[-1] == "pkg.train"
    assert env["OMP_NUM_THREADS"] == "3" and config.distributed_type == "MULTI_GPU"
    assert "--same_network" in said(recwarn) and "--gpu_ids" not in said(recwarn)  # --gpu_ids is read: all GPUs
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_fsdp_and_dynamo_flags(tmp_path, monkeypatch):
    _, env, config = build(
        tmp_path,
        monkeypatch,
        "--use_fsdp",
        "--num_processes",
        "2",
        "--fsdp_sharding_strategy",
        "SHARD_GRAD_OP",
        "--fsdp_transformer_layer_cls_to_wrap",
        "Block",
        "--dynamo_backend",
        "inductor",
        "--dynamo_use_fullgraph",
    )
    assert config.fsdp_config == {"reshard_after_forward": False, "transformer_layer_cls_to_wrap": ["Block"]}
    assert env["LOWBIT_DYNAMO_USE_FULLGRAPH"] == "true" and env["LOWBIT_DYNAMO_BACKEND"] == "inductor"


def test_boolean_flags_do_not_swallow_the_script(tmp_path, monkeypatch):
    command, _, config = build(tmp_path, monkeypatch, "--debug")
    assert config.debug is True and command[-1].endswith("train.py")


def test_num_processes_must_split_over_machines(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="total across machines"):
        build(tmp_path, monkeypatch, "--num_processes", "3", "--num_machines", "2", "--main_process_ip", "10.0.0.1")


def test_processes_sharing_the_cores_get_their_share_of_threads(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    _, env, _ = build(tmp_path, monkeypatch, "--cpu", "--num_processes", "4")
    assert env["OMP_NUM_THREADS"] == "4" and "4 processes share 16 CPU cores" in capsys.readouterr().err
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    _, env, _ = build(tmp_path, monkeypatch, "--cpu", "--num_processes", "4")
    assert "OMP_NUM_THREADS" not in env  # the user's choice stands


@pytest.mark.parametrize("value", ["t", "y", "T", "on", "Yes", "1"])
def test_accelerates_boolean_variables_read_with_accelerates_truth_values(value, monkeypatch):
    """``t``, ``y``, ``T`` and ``on`` were silently off in lowbit, where Accelerate reads them on."""
    from lowbit.kernel.env_numbers import accelerate_flag

    environ = {
        "ACCELERATE_USE_CPU": value,
        "ACCELERATE_USE_FSDP": value,
        "ACCELERATE_DYNAMO_BACKEND": "inductor",
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": value,
    }
    config = resolve_config(environ=environ, config_file=os.devnull, check_fp8_keys=False)
    assert config.use_cpu is True and config.distributed_type == "FSDP" and config.dynamo_use_fullgraph is True
    assert accelerate_flag("ACCELERATE_DEBUG_MODE", {"ACCELERATE_DEBUG_MODE": value})
    monkeypatch.setenv("ACCELERATE_USE_CPU", value)
    from lowbit.state import PartialState

    assert PartialState(cpu=False).device.type == "cpu"
    config = resolve_config(environ={"ACCELERATE_USE_CPU": "f"}, config_file=os.devnull, check_fp8_keys=False)
    assert not config.use_cpu
