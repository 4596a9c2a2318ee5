"""lowbit-deepspeed: config building on its own, and ZeRO 0-3 for real in 2 processes over gloo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lowbit_deepspeed")
pytest.importorskip("deepspeed")

import torch  # noqa: E402

from lowbit.kernel.errors import ConfigError  # noqa: E402
from lowbit.kernel.types import HardwareInfo, PrepareContext  # noqa: E402

from lowbit_deepspeed.ds_config import build_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core" / "builtin"))  # test_distributed.py
from helpers import LaunchedOnce  # noqa: E402
from test_distributed import assert_loss_decreases, launch, shared_launches  # noqa: E402


def context(mixed_precision="bf16", **kw):
    return PrepareContext(
        HardwareInfo("cpu", "CPU"),
        mixed_precision,
        torch.device("cpu"),
        world_size=2,
        gradient_accumulation_steps=kw.pop("gas", 1),
        batch_size=kw.pop("batch_size", 8),
        **kw,
    )


def test_auto_values_are_filled_from_the_accelerator():
    config = build_config(
        {
            "config": {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "bf16": {"enabled": "auto"},
            }
        },
        context(gas=4),
    )
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
        config["train_batch_size"],
    ) == (8, 4, 64)
    assert config["bf16"] == {"enabled": True}


def test_fp16_maps_to_dynamic_loss_scaling_and_keeps_every_docs_key():
    user = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 2}
    }
    config = build_config({"config": user}, context("fp16"))
    assert config["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "initial_scale_power": 16,
        "hysteresis": 3,
        "min_loss_scale": 2,
    }
    assert "bf16" not in config or not config["bf16"]["enabled"]


def test_fp8_runs_deepspeed_in_bf16():
    assert build_config({}, context("fp8"))["bf16"] == {"enabled": True}


def test_both_fp16_and_bf16_enabled_is_refused():
    with pytest.raises(ConfigError, match=r"both fp16.enabled=true and bf16.enabled=true"):
        build_config({"config": {"fp16": {"enabled": True}, "bf16": {"enabled": True}}}, context())


def test_config_contradicting_mixed_precision_names_both_values():
    with pytest.raises(ConfigError, match=r"fp16.enabled=true but mixed_precision='bf16'"):
        build_config({"config": {"fp16": {"enabled": True}}}, context("bf16"))


def test_section_keys_map_to_zero_settings():
    config = build_config(
        {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu", "gradient_clipping": 1.0},
        context(),
    )
    zero = config["zero_optimization"]
    assert (
        zero["stage"] == 3
        and zero["offload_optimizer"] == {"device": "cpu"}
        and zero["offload_param"] == {"device": "cpu"}
    )
    assert config["gradient_clipping"] == 1.0


def test_json_file_errors_name_the_path_and_line(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.json' does not exist"):
        build_config({"deepspeed_config_file": str(tmp_path / "nope.json")}, context())
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "zero_optimization": {"stage": 2},\n  oops\n}')
    with pytest.raises(ConfigError, match=r"bad.json' is not valid JSON, line 3"):
        build_config({"deepspeed_config_file": str(bad)}, context())
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}))
    assert build_config({"deepspeed_config_file": str(good)}, context())["zero_optimization"]["stage"] == 1


def test_bad_stage_and_unknown_key():
    with pytest.raises(ConfigError, match=r"zero_stage must be 0, 1, 2 or 3; got 5"):
        build_config({"zero_stage": 5}, context())
    with pytest.raises(ConfigError, match=r"Did you mean 'zero_stage'"):
        build_config({"zero_stag": 2}, context())


def test_launch_refuses_zero_stage_5(tmp_path, capsys):
    from lowbit.cli.main import main

    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["launch", "--use_deepspeed", "--zero_stage", "5", str(script)]) == 2
    assert "zero_stage must be 0, 1, 2 or 3" in capsys.readouterr().err


def test_use_deepspeed_without_the_plugin_says_what_to_install(tmp_path, capsys, monkeypatch):
    from lowbit.cli.main import main

    monkeypatch.setenv("LOWBIT_PLUGINS", "ao")  # as if lowbit-deepspeed were not installed
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["launch", "--use_deepspeed", str(script)]) == 2
    assert "pip install lowbit-deepspeed" in capsys.readouterr().err


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The scenarios of test_distributed.py's TOGETHER groups, one launch per group."""
    return shared_launches(tmp_path_factory)


@pytest.fixture(scope="module")
def zero0(tmp_path_factory):
    """ZeRO-0 in 2 processes, with torch's C++ extension cache pointed at an empty folder, as in a
    new virtual environment (results[0]["extensions_built"] lists what was compiled into it); one
    launch per test session."""

    def run(work: Path) -> list[dict]:
        extensions = work / "torch_extensions"
        results = launch(
            work,
            "ds",
            "--use_deepspeed",
            "--zero_stage",
            "0",
            "--mixed_precision",
            "bf16",
            env_extra={"TORCH_EXTENSIONS_DIR": str(extensions)},
        )
        results[0]["extensions_built"] = sorted(p.name for p in extensions.iterdir()) if extensions.exists() else []
        return results

    return LaunchedOnce(tmp_path_factory, "deepspeed")(("zero0",), run)


@pytest.mark.multiprocess
def test_deepspeed_on_cpu_compiles_nothing_at_launch(zero0):
    """DeepSpeed builds its shared-memory collectives (deepspeed_shm_comm, 30-150 s with the system
    compiler) when its communication backend starts on CPU; training never uses them."""
    assert zero0[0]["extensions_built"] == [], f"DeepSpeed compiled {zero0[0]['extensions_built']} at launch"


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_train_and_shard_state(shared, zero0, stage):
    results, _ = shared("ds", "--use_deepspeed", "--zero_stage", str(stage), "--mixed_precision", "bf16")
    rank0 = results[0]
    assert rank0["strategy"] == "deepspeed"
    assert_loss_decreases(rank0["losses"])
    assert_loss_decreases(zero0[0]["losses"])
    state_ratio = rank0["optimizer_state_bytes"] / zero0[0]["optimizer_state_bytes"]
    param_ratio = rank0["param_bytes"] / zero0[0]["param_bytes"]
    print(
        f"ZeRO-{stage}: optimizer-state bytes per rank / ZeRO-0's = {state_ratio:.3f}; parameter bytes = "
        f"{param_ratio:.3f}"
    )
    assert 0.4 <= state_ratio <= 0.6
    if stage == 3:
        assert 0.4 <= param_ratio <= 0.6


@pytest.mark.multiprocess
def test_fp8_under_zero2(tmp_path):
    pytest.importorskip("lowbit_ao")
    results = launch(tmp_path, "fp8-ds", "--use_deepspeed", "--zero_stage", "2", "--mixed_precision", "fp8")
    assert results[0]["fp8_backend"] == "ao" and results[0]["strategy"] == "deepspeed"
    assert_loss_decreases(results[0]["losses"])


@pytest.mark.multiprocess
def test_zero3_checkpoint_resume(shared):
    results, _ = shared("resume", "--use_deepspeed", "--zero_stage", "3", "--mixed_precision", "bf16")
    assert all(r["resumed_equals_uninterrupted"] for r in results)


@pytest.fixture(scope="module")
def clip_under_ddp(tmp_path_factory):
    launched = LaunchedOnce(tmp_path_factory, "deepspeed")
    return {
        precision: launched(
            ("clip under ddp", precision), lambda work: launch(work, "clip", "--mixed_precision", precision)
        )
        for precision in ("no", "bf16")
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage, precision", [(0, "no"), (2, "bf16"), (3, "bf16")])
def test_clip_grad_norm_clips_under_deepspeed_as_under_ddp(shared, clip_under_ddp, stage, precision):
    """DeepSpeed clips inside its own step: accelerator.clip_grad_norm_ must still take effect
    (the step waits for it) and return the real norm, as under DDP."""
    ours, _ = shared("clip", "--use_deepspeed", "--zero_stage", str(stage), "--mixed_precision", precision)
    reference = clip_under_ddp[precision][0]
    assert reference["norm"] > 0.2 and reference["update"] == pytest.approx(0.05, rel=0.05)  # DDP clipped
    assert ours[0]["update"] is not None  # the main process holds the gathered weights (ZeRO-3: it alone)
    for rank in ours:
        assert rank["norm"] == pytest.approx(reference["norm"], rel=0.02)
        if rank["update"] is not None:
            assert rank["update"] == pytest.approx(0.05, rel=0.05), "the update was not clipped to max_norm"


def test_zero3_state_dict_gathers_one_layer_at_a_time_and_clipping_is_for_one_step(tmp_path):
    """get_state_dict under ZeRO-3 gathered every parameter at once on every rank (the whole
    model per GPU); clip_grad_norm_ left DeepSpeed's gradient_clipping at its max_norm for every
    later step, and in the checkpoint's config. One process, real DeepSpeed over gloo."""
    import os
    import subprocess

    script = Path(__file__).with_name("zero3_gather_worker.py")
    env = {
        **os.environ,
        "LOWBIT_DISTRIBUTED_TYPE": "DEEPSPEED",
        "LOWBIT_DEEPSPEED_CONFIG": json.dumps({"zero_stage": 3, "gradient_clipping": 1.0}),
    }
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["full"] and all(equal and device == "cpu" for _, equal, device in result["full"].values()), result[
        "full"
    ]
    assert result["largest_gather"] == result["largest_layer"] < result["total"]
    assert result["clipping_after"] == [1.0, 1.0]


def test_a_step_deepspeed_skips_is_reported_and_holds_the_lr_schedule():
    """DeepSpeed's ZeRO optimizers check the gradients for inf/NaN themselves (fp16's loss scaling,
    bf16's check_grad_overflow) and skip that step: lowbit reported it as taken and stepped the LR
    schedule on it (fp16 runs begin with several such steps, so warm-up drifted). One process, real
    DeepSpeed ZeRO-2 in bf16 over gloo."""
    import os
    import subprocess

    script = Path(__file__).with_name("overflow_worker.py")
    env = {
        **os.environ,
        "LOWBIT_DISTRIBUTED_TYPE": "DEEPSPEED",
        "LOWBIT_DEEPSPEED_CONFIG": json.dumps({"zero_stage": 2}),
    }
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])["steps"]
    assert all(step["finite_loss"] for step in steps)
    assert [step["skipped"] for step in steps] == [False, True, False] == [step["accelerator_says"] for step in steps]
    assert [step["weights_moved"] for step in steps] == [True, False, True]
    assert [step["lr"] for step in steps] == pytest.approx([1e-2 / 2, 1e-2 / 2, 1e-2 / 3])
