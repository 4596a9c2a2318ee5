"""The FP8 payoff prediction: its model counts, its calibration, its validation against published
end-to-end figures, the ``lowbit fp8-payoff`` command and the FP8 report's clause."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest
import torch
from helpers import ROOT, tiny_llama

from lowbit.cli.fp8_payoff_command import installed_costs
from lowbit.cli.main import main

from lowbit.kernel.errors import ConfigError

from lowbit.runtime.observe.fp8_payoff import (
    LinearShape,
    ModelWork,
    count_work,
    known_gpu,
    predict,
    report_prediction,
    report_work,
    slower_layers,
)
from lowbit.runtime.observe.gpu_specs import gpu_peak

transformers = pytest.importorskip("transformers")
pytest.importorskip("lowbit_ao")  # the recipes' costs are the backends' (lowbit-ao's here)
H100 = "NVIDIA H100 80GB HBM3"


def cost(recipe="tensorwise"):
    return installed_costs("ao")[recipe][1]


def _validation():
    spec = importlib.util.spec_from_file_location("fp8_payoff_validation", ROOT / "bench" / "fp8_payoff_validation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_required_published_speedups_are_predicted_within_a_tenth():
    """Issue #37's bar: Llama-3-8B at 8192 tokens per GPU, H100 tensorwise / rowwise and B200
    mxfp8, within +-0.10 of the published 1.25, 1.10, 1.20 (figures the calibration never saw)."""
    bench = _validation()
    rows = {(gpu, recipe): (published, predicted) for gpu, recipe, published, predicted, _ in bench.validation_rows()}
    for key in bench.REQUIRED:
        published, predicted = rows[key]
        assert abs(predicted - published) <= bench.TOLERANCE, (key, published, predicted)
    # the ranking the published figures show: tensorwise pays more than rowwise on both GPUs
    assert rows[("H100", "tensorwise")][1] > rows[("H100", "rowwise")][1]
    assert rows[("B200", "tensorwise")][1] > rows[("B200", "rowwise")][1]


def test_the_calibration_point_is_met_and_a_small_linear_is_predicted_slower_in_fp8():
    rows = _validation().calibration_rows()
    (_, big_published, big_predicted, _), (_, small_published, small_predicted, _) = rows
    assert abs(big_predicted - big_published) < 0.02
    assert small_predicted < 1.0 and small_published < 1.0


def test_the_command_prints_the_layer_table_and_the_speedup_last(capsys):
    path = ROOT / "examples" / "models" / "llama3-8b.json"
    assert (
        main(
            [
                "fp8-payoff",
                str(path),
                "--tokens",
                "8192",
                "--gpu",
                "H100",
                "--recipe",
                "tensorwise",
                "--activation_checkpointing",
                "op",
                "--shards",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"predicted step speedup: \d\.\d\dx", out[-1]), out[-1]
    table = "\n".join(out)
    assert "model.layers.*.mlp.gate_proj" in table and "8192x4096x14336" in table
    assert "lm_head" in table and "bf16: last Linear" in table
    assert "attention (unchanged)" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu", "H10"], "Did you mean 'H100'"),
        (["--gpu", "H100", "--recipe", "nvfp4", "--backend", "te"], "no FP4 tensor cores"),
        (["--gpu", "H100", "--recipe", "nvfp4", "--backend", "ao"], "backend 'ao' declares no cost for recipe 'nvfp4'"),
        (["--gpu", "H100", "--recipe", "rowwse"], "Did you mean 'rowwise'"),
        (["--gpu", "H100", "--seq_len", "3000"], "multiple of --seq_len"),
    ],
)
def test_bad_input_gets_a_clear_error(argv, message, capsys):
    path = ROOT / "examples" / "models" / "llama3-8b.json"
    assert main(["fp8-payoff", str(path), "--tokens", "8192", *argv]) == 2
    assert message in capsys.readouterr().err


def test_counting_reads_the_model_without_touching_it_and_attention_matches_torchs_flop_counter():
    """The Linear shapes and attention FLOPs of a real (CPU) model, traced on the meta device with
    stand-ins: its weights stay where and what they were; torch's own FlopCounterMode on a real
    forward of a non-causal model counts the same attention and Linear FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    config = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
    )
    model = transformers.BertModel(config, add_pooling_layer=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    work = count_work(model, 2, 32)
    assert all(torch.equal(before[k], v) and v.device.type == "cpu" for k, v in model.state_dict().items())
    assert len(work.linears) == 12 and {layer.tokens for layer in work.linears} == {64}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.zeros(2, 32, dtype=torch.long))
    # This CPU runs SDPA as two batched matmuls (torch's math path); the Linears are the addmms.
    counts = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert work.attention_flops == counts["aten.bmm"]
    assert 3 * counts["aten.addmm"] == sum(
        6 * layer.tokens * layer.in_features * layer.out_features for layer in work.linears
    )
    assert 0 < work.pointwise_bytes < work.pointwise_bytes_eager


def test_a_causal_lm_counts_half_the_attention_and_gpt2s_conv1d_layers_are_linears():
    llama = count_work(tiny_llama(vocab_size=256, max_position_embeddings=64), 2, 32)
    layers, batch, heads, seq, head_dim = 2, 2, 4, 32, 16
    # QK^T and PV, 2 FLOPs per multiply-add, over the causal half of the score matrix
    assert llama.attention_flops == layers * 2 * batch * heads * (seq * seq / 2) * (head_dim + head_dim)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    )
    shapes = {layer.name: (layer.in_features, layer.out_features) for layer in count_work(gpt2, 1, 32).linears}
    assert shapes["transformer.h.0.attn.c_attn"] == (64, 192) and shapes["lm_head"] == (64, 256)


def test_small_layers_are_slower_in_fp8_and_large_ones_faster():
    gpu = known_gpu("H100")
    work = ModelWork(
        [
            LinearShape("small", 8192, 512, 512),
            LinearShape("large", 8192, 8192, 8192),
            LinearShape("odd", 8192, 8192, 8200),
        ]
    )
    layers = {p.layer.name: p for p in predict(work, gpu, "tensorwise", cost(), auto=True).layers}
    assert layers["small"].low_s is None and layers["small"].kept.startswith("auto")
    assert layers["large"].low_s < layers["large"].bf16_s / 1.3
    assert layers["odd"].kept == "dims not divisible by 16"
    assert list(
        slower_layers({"small": (512, 512), "large": (8192, 8192)}, 8192, H100, "tensorwise", cost(), True)
    ) == ["small"]


def test_eager_runs_pay_less_than_compiled_ones():
    work = count_work(tiny_llama(vocab_size=256, max_position_embeddings=64), 8, 64)
    gpu = known_gpu("H100")
    assert (
        predict(work, gpu, "tensorwise", cost(), compiled=False).speedup
        < predict(work, gpu, "tensorwise", cost()).speedup
    )


def test_the_fp8_report_predicts_on_a_known_gpu_and_says_nothing_elsewhere():
    model = tiny_llama(vocab_size=256, max_position_embeddings=64)
    work = report_work(model, H100)
    assert work is not None and work.attention_flops > 0
    costs = {recipe: c for recipe, (_, c) in installed_costs().items()}
    clause = report_prediction(work, H100, "tensorwise", costs, {}, compiled=True)
    assert re.search(r"predicted step \d\.\d\dx over bf16 on this H100 at 8192 tokens", clause), clause
    assert report_work(model, "CPU") is None and report_prediction(None, "CPU", "tensorwise", costs, {}, True) == ""
    assert report_prediction(work, H100, "Float8LinearConfig", costs, {}, True) == ""  # no named recipe, no prediction
    fp4 = {"nvfp4": dataclasses.replace(cost(), format="fp4")}
    assert report_prediction(work, H100, "nvfp4", fp4, {}, True) == ""  # no FP4 tensor cores on an H100


def test_unknown_recomputation_is_refused():
    with pytest.raises(ConfigError, match="activation checkpointing"):
        predict(ModelWork([]), known_gpu("H100"), "tensorwise", cost(), recompute="some")


def test_a_prepared_model_is_predicted_from_code_with_its_own_recipe_and_kept_layers():
    """``accelerator.fp8_payoff()``: the run's recipe (rowwise here), the layers the FP8 report
    kept, the GPU named (a CPU has no figures: refused, naming the table)."""
    from lowbit import Accelerator
    from lowbit.utils import AORecipeKwargs

    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(recipe="rowwise")])
    model = accelerator.prepare(tiny_llama(vocab_size=256, max_position_embeddings=64))
    prediction = accelerator.fp8_payoff(tokens=8192, seq_len=64, gpu="H100")
    assert prediction.recipe == "rowwise" and prediction.gpu.name == "H100"
    kept = {p.layer.name for p in prediction.layers if p.low_s is None}
    assert kept == set(accelerator._run.prepared.conversion_reports[model].skipped)
    assert {p.layer.tokens for p in prediction.layers} == {8192}
    if gpu_peak(accelerator._run.context.hardware.device_name) is None:  # a CPU: no default GPU to predict for
        with pytest.raises(ConfigError, match="no figures for GPU"):
            accelerator.fp8_payoff()
    with pytest.raises(ConfigError, match="low-precision backend"):
        Accelerator(mixed_precision="bf16").fp8_payoff(tiny_llama(vocab_size=256, max_position_embeddings=64))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])  # rowwise_with_gw_hp: refused on a CPU
def test_a_recipe_given_accelerates_way_is_predicted_as_its_name(recipe):
    """AORecipeKwargs(config=Float8LinearConfig.from_recipe_name(...)), as Accelerate's docs build it."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig

    from lowbit import Accelerator
    from lowbit.utils import AORecipeKwargs

    config = Float8LinearConfig.from_recipe_name(recipe)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=config)])
    accelerator.prepare(tiny_llama(vocab_size=256, max_position_embeddings=64))
    named = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(recipe=recipe)])
    named.prepare(tiny_llama(vocab_size=256, max_position_embeddings=64))
    prediction = accelerator.fp8_payoff(tokens=8192, seq_len=64, gpu="H100")
    assert prediction.recipe == recipe
    assert prediction.speedup == named.fp8_payoff(tokens=8192, seq_len=64, gpu="H100").speedup


def test_a_model_that_refuses_the_example_batch_is_a_clear_error(tmp_path, capsys):
    """A vision model takes pixels, not token ids: the error says what was tried and what to do."""
    config = tmp_path / "config.json"
    config.write_text(
        '{"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, '
        '"intermediate_size": 128}'
    )
    assert main(["fp8-payoff", str(config), "--tokens", "64", "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert "ViTModel did not run on an example batch" in err and "module:factory" in err


def test_counting_a_plain_module_in_training_mode_leaves_its_running_statistics_alone():
    """A model returning a bare tensor, in train mode with a BatchNorm: its buffers are not updated."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    work = count_work(model, 4, 16)
    assert [(layer.tokens, layer.in_features, layer.out_features) for layer in work.linears] == [
        (4, 32, 64),
        (4, 64, 8),
    ]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.training


def test_the_report_falls_back_to_the_linear_layers_when_the_forward_cannot_be_traced():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 30 * 30, 4096),
        torch.nn.Linear(4096, 4096),
        torch.nn.Linear(4096, 10),
    )
    work = report_work(model, H100)
    assert [layer.tokens for layer in work.linears] == [8192] * 3 and work.attention_flops == 0
    clause = report_prediction(work, H100, "tensorwise", {"tensorwise": cost()}, {}, True)
    assert clause.startswith("predicted Linear layers (a forward could not be traced)"), clause


def test_a_frozen_base_is_predicted_with_two_gemms_and_no_weight_cast():
    """LoRA's frozen bases: bf16 runs their forward and input-gradient GEMMs only (autograd skips the
    weight's), and a frozen FP8 base the same two in FP8, its weight quantized once (no cast a step)."""
    from lowbit.runtime.observe.fp8_payoff import LinearShape, ModelWork, cast_seconds, predict

    _, cost = installed_costs()["tensorwise"]
    gpu = known_gpu("h100")
    trained = LinearShape("trained", 8192, 4096, 4096)
    frozen = dataclasses.replace(trained, name="frozen", frozen=True)
    one, other = predict(ModelWork([trained, frozen]), gpu, "tensorwise", cost).layers
    assert other.bf16_s == pytest.approx(one.bf16_s * 2 / 3, rel=0.02)  # square GEMMs: a third each
    assert cast_seconds(frozen, gpu, cost, True, 0.0) < cast_seconds(trained, gpu, cost, True, 0.0)
    assert other.low_s <= one.low_s * 2 / 3 * (1 + 1e-9)  # two thirds of the GEMMs, and less casting


def test_the_count_marks_a_lora_models_frozen_bases_and_its_adapters_are_kept_in_the_prediction():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    work = count_work(model, 1, 64)
    frozen = {layer.name for layer in work.linears if layer.frozen}
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer" in frozen
    assert not any(".lora_" in name for name in frozen)  # adapters train
