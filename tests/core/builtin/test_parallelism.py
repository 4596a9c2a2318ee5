"""N-D parallelism with Accelerate's ParallelismConfig: HSDP, tensor parallelism, FSDP2 x TP, with
FP8 (lowbit-ao's float8 TP styles) and activation checkpointing; each layout against plain PyTorch
on one process over the same global batch."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import TESTS, LaunchedOnce, launch_argv, run_launch, said, tiny_llama
from torch import nn

from lowbit.cli.flags import add_config_flags, raw_config_from_args
from lowbit.parallelism_config import (
    DeepSpeedSequenceParallelConfig,
    ParallelismConfig,
    TorchTensorParallelConfig,
    settle_layout,
)

from lowbit.kernel.errors import ConfigError
from lowbit.kernel.types import PrepareContext

from lowbit.runtime.builtin.activation_checkpointing import checkpoint_blocks
from lowbit.runtime.builtin.tensor_parallel import apply_tensor_parallel, expand_plan
from lowbit.runtime.training.toolchain import find_cxx_compiler

from lowbit.run.accelerate_config import settings_from_accelerate_env

WORKER = TESTS / "distributed" / "layout_worker.py"
transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------ the config


def test_sizes_come_from_accelerates_launcher_variables_and_default_to_one(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    layout = ParallelismConfig(dp_shard_size=2)
    assert (layout.dp_replicate_size, layout.dp_shard_size, layout.tp_size, layout.cp_size) == (1, 2, 2, 1)
    assert layout.active_mesh_dims == ["dp_shard", "tp"] and layout.dp_dim_names == ["dp_shard"]
    assert layout.fsdp_dim_names == ["dp_shard_cp"] and layout.non_data_parallel_size == 2 and layout.total_size == 4
    assert isinstance(layout.tp_handler, TorchTensorParallelConfig)
    assert ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp_size": 0}, "whole number >= 1"),
        ({"dp_replicate_size": 2, "tp_size": 2}, "needs dp_shard_size > 1"),
        ({"cp_backend": "ring"}, "cp_backend"),
    ],
)
def test_layouts_lowbit_cannot_run_are_refused_when_made(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelismConfig(**kwargs)


def test_sequence_parallelism_is_made_as_in_accelerate_and_refused_when_the_run_is_laid_out():
    layout = ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig())
    with pytest.raises(ConfigError, match="sequence parallelism"):
        settle_layout(layout, {}, "the settings", 2, "cpu", "fsdp", ("dp_shard",), {})
    with pytest.raises(ConfigError, match="sp_attn_implementation 'eager'"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")


def test_a_config_section_with_a_misspelt_key_names_the_right_one():
    with pytest.raises(ConfigError, match="Did you mean 'tp_size'"):
        ParallelismConfig.from_section({"tp_sise": 2}, "the settings")
    assert ParallelismConfig.from_section({"tp_size": "2"}, "f").tp_size == 2


def test_the_layout_must_fit_the_job_and_the_strategy():
    with pytest.raises(ConfigError, match="lays out 4 processes .* the job has 2"):
        ParallelismConfig(dp_shard_size=2, tp_size=2).fit_to(2, "fsdp", ("dp_shard", "tp"), {})
    with pytest.raises(ConfigError, match="'ddp' strategy does not lay out.*Use distributed_type fsdp"):
        ParallelismConfig(dp_shard_size=2).fit_to(
            2, "ddp", ("dp_replicate", "tp"), {"ddp": ("dp_replicate", "tp"), "fsdp": ("dp_shard", "tp")}
        )
    spread = ParallelismConfig()
    spread.fit_to(4, "fsdp", ("dp_replicate", "dp_shard"), {})
    assert spread.dp_shard_size == 4  # all ones: every process shards


def test_launcher_flags_and_accelerate_variables_fill_the_section():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"])
    assert raw_config_from_args(args)["parallelism_config"] == {"dp_shard_size": "2", "tp_size": "2"}
    environ = {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_TP_SIZE": "2",
        "PARALLELISM_CONFIG_SP_SIZE": "1",
        "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
    }
    assert settings_from_accelerate_env(environ)["parallelism_config"] == {"tp_size": "2"}


def test_one_process_has_a_layout_but_no_mesh_and_context_parallel_is_refused_on_cpu():
    from lowbit import Accelerator

    accelerator = Accelerator(parallelism_config=ParallelismConfig())
    assert accelerator.parallelism_config.total_size == 1 and accelerator.torch_device_mesh is None
    assert accelerator.tensor_parallel_rank == 0 and accelerator.data_parallel_shard_rank == 0
    with accelerator.maybe_context_parallel(buffers=[torch.zeros(2, 4)], buffer_seq_dims=[1]):
        pass  # cp_size 1: nothing to split (a note says so)
    with pytest.raises(ConfigError, match="context parallelism, which torch runs on CUDA GPUs only"):
        Accelerator(parallelism_config=ParallelismConfig(cp_size=2))
    with pytest.raises(ConfigError, match="No parallel layout"):
        _ = Accelerator().tensor_parallel_rank


# ------------------------------------------------------------------ tensor-parallel plans


def tp_context(tp: int, **handler) -> PrepareContext:
    layout = ParallelismConfig(dp_shard_size=1, tp_size=tp, tp_handler=TorchTensorParallelConfig(**handler))
    return PrepareContext(hardware=None, mixed_precision="no", device=torch.device("cpu"), parallelism=layout)


def test_a_plan_pattern_matches_each_block():
    model = tiny_llama()
    layout = expand_plan(model, model._tp_plan)
    assert layout["model.layers.1.mlp.down_proj"] == "rowwise" and layout["lm_head"] == "colwise_gather_output"
    assert len([name for name in layout if name.startswith("model.layers.")]) == 14


@pytest.mark.parametrize(
    "model, handler, message",
    [
        (nn.Sequential(nn.Linear(8, 8)), {}, "has no tensor-parallel plan"),
        (nn.Sequential(nn.Linear(8, 8)), {"plan": {"5": "colwise"}}, "names no module"),
        (nn.Sequential(nn.Linear(8, 6)), {"plan": {"0": "colwise"}}, "6 does not divide by 4"),
        (
            nn.Sequential(nn.Linear(8, 8)),
            {"plan": {"0": "packed_colwise"}},
            "'packed_colwise', which lowbit does not offer",
        ),
    ],
)
def test_plans_lowbit_cannot_lay_out_are_errors_before_any_collective(model, handler, message):
    with pytest.raises(ConfigError, match=message):
        apply_tensor_parallel(model, tp_context(4, **handler))


def test_attention_heads_must_divide_by_the_tensor_parallel_ranks():
    with pytest.raises(ConfigError, match="num_key_value_heads is 2, which does not divide by 4"):
        apply_tensor_parallel(tiny_llama(), tp_context(4))


def test_lowbit_ao_lays_its_tensorwise_float8_layers_out_with_torchaos_float8_styles():
    pytest.importorskip("lowbit_ao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from lowbit_ao.convert import tensor_parallel_style

    tensorwise = convert_to_float8_training(nn.Sequential(nn.Linear(16, 16)), config=Float8LinearConfig(emulate=True))[
        0
    ]
    rowwise = convert_to_float8_training(
        nn.Sequential(nn.Linear(16, 16)), config=Float8LinearConfig.from_recipe_name("rowwise")
    )[0]
    assert isinstance(tensorwise_style := tensor_parallel_style(tensorwise, "colwise"), Float8ColwiseParallel), (
        tensorwise_style
    )
    assert isinstance(tensor_parallel_style(tensorwise, "rowwise"), Float8RowwiseParallel)
    assert tensor_parallel_style(rowwise, "colwise") is None  # torch's plain style: float8 TP styles scale per tensor
    assert tensor_parallel_style(nn.Linear(16, 16), "colwise") is None
    assert tensor_parallel_style(tensorwise, "embedding_rowwise") is None


# ------------------------------------------------------------------ activation checkpointing


def gradients(mode, **config):
    model = tiny_llama(**config)
    checkpoint_blocks(model, list(model.model.layers), mode)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_give_the_same_gradients(mode, recwarn):
    """Recomputation repeats the same ops in fp32: the gradients are equal to the last bit."""
    loss, plain, _ = gradients(False)
    checkpointed_loss, checkpointed, model = gradients(mode)
    assert torch.equal(loss, checkpointed_loss)
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name
    assert model.config.use_cache is False and "use_cache set to False" in said(recwarn)


# ------------------------------------------------------------------ layouts, 2 and 4 processes over gloo


def run_layouts(folder: Path, world: int, runs: tuple[tuple[str, ...], ...], flags: tuple[str, ...] = ()) -> list:
    """One launch running each of ``runs`` (its keys) in turn: each one's result."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    specs = [",".join(keys) for keys in runs]
    cmd = launch_argv("--cpu", "--num_processes", str(world), *flags, str(WORKER), str(folder), *specs)
    proc = run_launch(cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((folder / str(index) / "result.json").read_text()) for index in range(len(runs))]


def run_layout(folder: Path, world: int, *keys: str, flags: tuple[str, ...] = ()) -> dict:
    return run_layouts(folder, world, (keys,), flags)[0]


# fp32 layouts sum the same numbers in another order: equal to 1e-4. bf16 and float8 round each
# layout's shards and collectives differently (float8: each weight's scale is taken over its shards
# and inputs are cast before the tensor-parallel collective); measured here within 0.3% of fp32's
# loss over 4 steps, checked at 1%.
TOLERANCE = {"no": dict(abs=1e-4), "bf16": dict(rel=1e-2), "fp8": dict(rel=1e-2)}

LAYOUTS = {
    "tp": (2, ("tp_size=2",), ()),
    "fsdp-x-tp": (4, ("dp_shard_size=2", "tp_size=2"), ("--use_fsdp",)),
    "hsdp-selective-ac": (4, ("dp_replicate_size=2", "dp_shard_size=2", "ac=selective"), ("--use_fsdp",)),
    # FSDP2 casts each block's inputs to bf16 in its hooks: outside the checkpointed region
    "bf16-fsdp-selective-ac": (2, ("dp_shard_size=2", "mp=bf16", "ac=selective"), ("--use_fsdp",)),
    "fp8-fsdp-x-tp-full-ac": (4, ("dp_shard_size=2", "tp_size=2", "mp=fp8", "ac=full"), ("--use_fsdp",)),
    "fp8-tp": (2, ("tp_size=2", "mp=fp8"), ()),
    # rowwise scales per row: torch's plain styles lay its float8 layers out (as torchtitan pairs them)
    "fp8-rowwise-tp": (2, ("tp_size=2", "mp=fp8", "recipe=rowwise"), ()),
    # torch.compile at scale: inductor compiling each block once under FSDP2 with checkpointing and
    # fp8; the whole model under DDP, as dynamo splits it at DDP's buckets (aot_eager: inductor's C++
    # compiles cost CI about 45 CPU-seconds a layout on a cold cache, and the fp8 layout has them)
    "fp8-fsdp-selective-ac-regional-compile": (
        2,
        ("dp_shard_size=2", "mp=fp8", "ac=selective", "compile=regional"),
        ("--use_fsdp",),
    ),
    "bf16-ddp-compile": (2, ("dp_replicate_size=2", "mp=bf16", "compile=whole", "backend=aot_eager"), ()),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """``layouts(name)``: the layout's result, from one launch per (processes, flags) running each
    of those LAYOUTS that can run here in turn (a launch costs 9 to 17 CPU-seconds of start-up); once
    per test session, by the first test to ask."""
    launched = LaunchedOnce(tmp_path_factory, "layouts")

    def result(name: str) -> dict:
        world, _, flags = LAYOUTS[name]
        group = tuple(n for n, (w, args, f) in LAYOUTS.items() if (w, f) == (world, flags) and runs_here(args))
        results = launched(
            (world, flags, group), lambda work: run_layouts(work, world, [LAYOUTS[n][1] for n in group], flags)
        )
        return results[group.index(name)]

    return result


def runs_here(args: tuple[str, ...]) -> bool:
    """Whether this machine has what a layout needs: lowbit-ao for fp8, a C++ compiler for inductor."""
    if "mp=fp8" in args and importlib.util.find_spec("lowbit_ao") is None:
        return False
    return not (inductor_compiles(args) and find_cxx_compiler() is None)


def inductor_compiles(args: tuple[str, ...]) -> bool:
    return any(arg.startswith("compile=") for arg in args) and "backend=aot_eager" not in args


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_trains_like_one_process_on_the_global_batch(layouts, name):
    world, args, flags = LAYOUTS[name]
    if "mp=fp8" in args:
        pytest.importorskip("lowbit_ao")
    if inductor_compiles(args) and find_cxx_compiler() is None:
        pytest.skip("inductor on a CPU needs a C++ compiler")
    result = layouts(name)
    sizes = dict(arg.split("=") for arg in args if arg.endswith(tuple("0123456789")) and "_size" in arg)
    assert result["mesh"] == {k[: -len("_size")]: int(v) for k, v in sizes.items()}
    precision = next((a.split("=")[1] for a in args if a.startswith("mp=")), "no")
    assert result["losses"] == pytest.approx(result["reference"], **TOLERANCE[precision]), result
    if precision == "fp8":
        recipe = next((a.split("=")[1] for a in args if a.startswith("recipe=")), "tensorwise")
        assert result["fp8_report"].startswith(f"fp8 (ao, {recipe}, emulated): 13 of 15 Linear layers"), result[
            "fp8_report"
        ]


# ------------------------------------------------------------------ Accelerate's example, import changed

ND_SCRIPT = TESTS / "accelerate_style" / "nd_parallel.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world, flags, sizes, steps",
    [
        (2, (), ("--tp-size", "2"), 8),  # laid out by transformers at load time; both ranks see every batch of 2
        (4, ("--use_fsdp",), ("--dp-replicate-size", "2", "--dp-shard-size", "2"), 2),  # HSDP: 16 samples over 4 ranks
    ],
)
def test_accelerates_nd_parallel_example_trains_checkpoints_and_saves_whole_weights(
    tmp_path, world, flags, sizes, steps
):
    model_dir = tmp_path / "tiny"
    tiny_llama(use_cache=False).save_pretrained(model_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = launch_argv(
        "--cpu", "--num_processes", str(world), *flags, str(ND_SCRIPT), str(model_dir), str(tmp_path / "out"), *sizes
    )
    proc = run_launch(cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["steps"] == steps and len(result["losses"]) == steps
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    for name, tensor in original.state_dict().items():  # whole weights, once, trained (SGD moved them)
        assert saved.state_dict()[name].shape == tensor.shape, name
    assert not torch.equal(
        saved.state_dict()["model.layers.0.mlp.up_proj.weight"],
        original.state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    assert (tmp_path / "out" / "checkpoint-1" / "lowbit_state.json").exists()


# ------------------------------------------------------------------ resuming on another layout or precision


RESHARDS = {  # saved on (processes, sizes), resumed on (processes, sizes), strategy flags
    "fsdp2-2-to-4": ((2, ("dp_shard_size=2",)), (4, ("dp_shard_size=4",)), ("--use_fsdp",)),
    # 4 processes to 2, and a 2-D mesh to a 1-D one
    "fsdp2xtp-to-fsdp2": ((4, ("dp_shard_size=2", "tp_size=2")), (2, ("dp_shard_size=2",)), ("--use_fsdp",)),
    "tp-to-tp": ((2, ("tp_size=2",)), (2, ("tp_size=2",)), ()),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", RESHARDS)
def test_a_checkpoint_saved_on_one_layout_resumes_on_another(tmp_path, name):
    """DCP reshards weights and AdamW states to another number of processes or mesh shape (tensor-
    parallel checkpoints are DCP too). A global step is the same rows on any layout, so the resumed
    steps equal one process's to fp32 precision."""
    (saved_on, saved_sizes), (resumed_on, resumed_sizes), flags = RESHARDS[name]
    ckpt = tmp_path / "ckpt"
    saving, resuming = (*saved_sizes, "steps=2", f"save={ckpt}"), (*resumed_sizes, f"resume={ckpt}")
    if saved_on == resumed_on:  # one launch: the resuming Accelerator after the saving one
        first, second = run_layouts(tmp_path / "both", saved_on, (saving, resuming), flags)
    else:
        first = run_layout(tmp_path / "first", saved_on, *saving, flags=flags)
        second = run_layout(tmp_path / "second", resumed_on, *resuming, flags=flags)
    assert first["losses"] == pytest.approx(first["reference"][:2], abs=1e-4)
    assert second["losses"] == pytest.approx(first["reference"][2:], abs=1e-4), (first, second)


@pytest.mark.multiprocess
def test_an_fp8_run_finishes_in_bf16_when_asked(tmp_path):
    """torchtitan's late precision switch: the fp8 (ao) state resumes in bf16 with
    ``allow_precision_change=True``; without it the error says how."""
    pytest.importorskip("lowbit_ao")
    ckpt = tmp_path / "ckpt"
    _, finish = run_layouts(  # one launch: the bf16 Accelerator resumes what the fp8 one saved
        tmp_path / "switch",
        2,
        (
            ("dp_shard_size=2", "mp=fp8", "steps=2", f"save={ckpt}"),
            ("dp_shard_size=2", "mp=bf16", f"resume={ckpt}", "switch=1"),
        ),
        ("--use_fsdp",),
    )
    assert finish["losses"] == pytest.approx(finish["reference"][2:], rel=1e-2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    cmd = launch_argv(
        "--cpu",
        "--num_processes",
        "2",
        "--use_fsdp",
        str(WORKER),
        str(tmp_path / "refused"),
        f"dp_shard_size=2,mp=bf16,resume={ckpt}",
    )
    proc = run_launch(cmd, env=dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode != 0 and "allow_precision_change=True" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("backend", ["lowbit_te", "lowbit_msamp"])
def test_fp8_backends_without_tensor_parallel_layouts_say_what_to_use(backend):
    """TE builds its tensor-parallel modules itself and MS-AMP's weights are its own tensors: both
    refuse tp_size > 1 before anything runs, naming the ao backend."""
    from lowbit.kernel.errors import UnsupportedCombinationError

    plugin = pytest.importorskip(backend)
    context = tp_context(2)
    with pytest.raises(UnsupportedCombinationError, match="tp_size=2.*ao backend"):
        plugin.check_compatibility(context)
