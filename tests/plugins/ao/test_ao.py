"""lowbit-ao: torchao float8 training, for real on CPU (emulated FP8 GEMMs)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lowbit_ao")
torchao_float8 = pytest.importorskip("torchao.float8")

import torch  # noqa: E402
from helpers import FakeBackend, mlp, regression_data  # noqa: E402
from safetensors.torch import load_file
from torch import nn  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.cli.self_test import train_steps  # noqa: E402
from lowbit.utils import AORecipeKwargs, FP8RecipeKwargs  # noqa: E402

from lowbit.kernel.errors import BackendUnavailableError, ConfigError, UnsupportedCombinationError  # noqa: E402

from lowbit.run.plugin_manager import make_plugin_manager  # noqa: E402

import lowbit_ao  # noqa: E402
from lowbit_ao.convert import EmulationNotice, default_module_filter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::lowbit_ao.convert.EmulationNotice")


def ao_accelerator(**recipe):
    return Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(**recipe)])


class Nested(nn.Module):
    """First and last Linear sit inside submodules: a leaf-only check gets them wrong."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(32, 64))
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2)])
        self.odd = nn.Linear(64, 40)
        self.head = nn.Sequential(nn.Sequential(nn.Linear(40, 16)))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.odd(x))


def test_ao_is_chosen_on_cpu_with_priority_100():
    acc = Accelerator(mixed_precision="fp8")
    assert acc.fp8_backend == "ao"
    assert "priority 100" in acc.explain_backend_choice()


def test_a_higher_priority_backend_beats_ao_and_explicit_ao_beats_it():
    manager = make_plugin_manager(extra_plugins=[FakeBackend("faster", 200)])
    assert Accelerator(mixed_precision="fp8", plugin_manager=manager).fp8_backend == "faster"
    manager = make_plugin_manager(extra_plugins=[FakeBackend("faster", 200)])
    assert (
        Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()], plugin_manager=manager).fp8_backend
        == "ao"
    )


def test_default_filter_keeps_first_and_last_linear_by_module_order_at_any_depth():
    model = Nested()
    _, skipped = default_module_filter(model, keep_first_last=True)
    assert skipped == {
        "embed.0": "first Linear kept in high precision",
        "head.0.0": "last Linear kept in high precision",
        "odd": "dims 64x40 not divisible by 16",
    }
    acc = ao_accelerator()
    prepared = acc.prepare(Nested())
    converted = {n for n, m in prepared.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {"blocks.0.0", "blocks.1.0"}


def test_user_filter_replaces_the_default():
    acc = ao_accelerator(module_filter_func=lambda module, fqn: fqn == "embed.0")
    prepared = acc.prepare(Nested())
    assert [n for n, m in prepared.named_modules() if isinstance(m, Float8Linear)] == ["embed.0"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_recipe_names_reach_torchao(recipe):
    acc = ao_accelerator(recipe=recipe)
    model = acc.prepare(mlp())
    layer = next(m for m in model.modules() if isinstance(m, Float8Linear))
    expected = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True, pad_inner_dim=True)
    assert layer.config == expected
    model(torch.randn(4, 32)).sum().backward()


def test_unknown_recipe_name_suggests():
    with pytest.raises(ConfigError, match=r"'rowise'.*Did you mean 'rowwise'"):
        AORecipeKwargs(recipe="rowise")


def test_wrong_type_in_float8_config_is_named():
    bad = Float8LinearConfig(emulate="yes")
    with pytest.raises(ConfigError, match=r"Float8LinearConfig.emulate expects bool, got 'yes'"):
        ao_accelerator(config=bad).prepare(mlp())


def test_rowwise_with_gw_hp_on_cpu_is_refused_at_prepare():
    with pytest.raises(UnsupportedCombinationError, match=r"rowwise_with_gw_hp.*CUDA"):
        ao_accelerator(recipe="rowwise_with_gw_hp").prepare(mlp())


def test_full_config_and_options_are_applied():
    config = Float8LinearConfig.from_recipe_name("rowwise")
    acc = ao_accelerator(config=config, pad_inner_dim=True, force_recompute_fp8_weight_in_bwd=True)
    model = acc.prepare(mlp())
    layer = next(m for m in model.modules() if isinstance(m, Float8Linear))
    assert layer.config.pad_inner_dim and layer.config.force_recompute_fp8_weight_in_bwd and layer.config.emulate
    assert layer.config.cast_config_input == config.cast_config_input


def test_emulation_is_automatic_on_cpu_and_said_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        acc = ao_accelerator()
        acc.prepare(mlp())
    notices = [w for w in caught if issubclass(w.category, EmulationNotice)]
    assert len(notices) == 1 and "CPU has no FP8 GEMMs" in str(notices[0].message)


def test_non_emulated_fp8_on_cpu_runs_torch_scaled_mm_with_a_note():
    """emulate=False on a CPU is torch._scaled_mm, the reference kernel: allowed, and said."""
    with pytest.warns(EmulationNotice, match=r"emulate=False on CPU: torch._scaled_mm runs lowbit-ao's FP8 GEMMs"):
        acc = ao_accelerator(emulate=False)
        model = acc.prepare(mlp())
    layer = next(m for m in model.modules() if isinstance(m, Float8Linear))
    assert layer.config.emulate is False
    x, y = regression_data(32)
    nn.functional.mse_loss(model(x), y).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_non_emulated_fp8_on_a_gpu_without_fp8_is_a_clear_error():
    from lowbit.kernel.types import HardwareInfo, PrepareContext

    from lowbit_ao.convert import build_float8_config

    a100 = HardwareInfo("cuda", "NVIDIA A100", 1, (8, 0))
    context = PrepareContext(
        a100, "fp8", torch.device("cpu"), backend_options=AORecipeKwargs(emulate=False, recipe="tensorwise")
    )
    with pytest.raises(BackendUnavailableError, match=r"emulate=False.*compute capability >= 8.9; found NVIDIA A100"):
        build_float8_config(context.backend_options, context)


@pytest.mark.parametrize("compiled", [False, True])
def test_float8_on_a_gpu_without_compile_says_what_to_expect(compiled, recwarn):
    """torchao's speedups are measured compiled; eager, its casts are kernels of their own."""
    from lowbit.kernel.types import HardwareInfo, PrepareContext

    from lowbit_ao.convert import check_compatibility

    h100 = HardwareInfo("cuda", "NVIDIA H100", 1, (9, 0))
    context = PrepareContext(
        h100, "fp8", torch.device("cuda"), backend_options=AORecipeKwargs(recipe="tensorwise"), compiled=compiled
    )
    check_compatibility(context)
    said = " ".join(str(w.message) for w in recwarn)
    assert ("without torch.compile" in said and "use_regional_compilation=True" in said) is not compiled, said


def test_model_without_eligible_linears_warns_and_trains_in_high_precision():
    model = nn.Sequential(nn.Linear(10, 30), nn.ReLU(), nn.Linear(30, 5))
    with pytest.warns(
        UserWarning, match=r"0 of 2 Linear layers; kept high precision: .*first Linear kept.*Nothing trains"
    ):
        prepared = ao_accelerator().prepare(model)
    prepared(torch.randn(3, 10)).sum().backward()


def test_settings_from_yaml_and_env(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: fp8\nfp8_config:\n  backend: ao\n  recipe: rowwise\n  pad_inner_dim: true\n")
    acc = Accelerator(config_file=path)
    assert acc.fp8_backend == "ao" and acc.fp8_options.recipe == "rowwise" and acc.fp8_options.pad_inner_dim is True
    monkeypatch.setenv("LOWBIT_FP8_RECIPE", "tensorwise")
    assert Accelerator(config_file=path).fp8_options.recipe == "tensorwise"  # env beats the file
    assert (
        Accelerator(
            config_file=path, kwargs_handlers=[FP8RecipeKwargs(backend="ao", recipe="rowwise")]
        ).fp8_options.recipe
        == "rowwise"
    )


def test_eval_pass_under_model_eval():
    acc = ao_accelerator()
    model = acc.prepare(mlp())
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(4, 32))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def _raw_torchao_training(steps, x, y):
    """The same conversion and config, applied by hand in a plain PyTorch loop."""
    model = mlp()
    module_filter, _ = default_module_filter(model, keep_first_last=True)
    convert_to_float8_training(model, module_filter_fn=module_filter, config=Float8LinearConfig(emulate=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        nn.functional.mse_loss(out.float(), y).backward()
        opt.step()
    return model


def _lowbit_training(steps, x, y, **recipe):
    acc = ao_accelerator(**recipe)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt, train_steps(acc, model, opt, x, y, steps)


def test_parity_with_raw_torchao_is_bitwise():
    x, y = regression_data(64)
    raw = _raw_torchao_training(20, x, y)
    _, ours, _, _ = _lowbit_training(20, x, y, emulation="torchao")
    for (name, a), b in zip(raw.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from raw torchao"


def _teacher_task(seed=0, n=512):
    g = torch.Generator().manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        x = torch.randn(n, 32, generator=g)
        return x, teacher(x)


def _train_precision(mixed_precision, x, y, steps=150):
    handlers = [AORecipeKwargs()] if mixed_precision == "fp8" else []
    acc = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers)
    model = mlp(seed=0, width=128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    for step in range(steps):
        batch = slice((step * 64) % len(x), (step * 64) % len(x) + 64)
        opt.zero_grad()
        acc.backward(nn.functional.mse_loss(model(x[batch]), y[batch]))
        opt.step()
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def test_fp8_converges_like_bf16():
    x, y = _teacher_task()
    start = nn.functional.mse_loss(torch.zeros_like(y), y).item()  # loss of predicting 0: the target variance
    fp8, bf16 = _train_precision("fp8", x, y), _train_precision("bf16", x, y)
    print(
        f"loss of predicting zero {start:.3f}; after 150 steps: fp8 {fp8:.5f}, bf16 {bf16:.5f}, "
        f"relative gap {abs(fp8 - bf16) / bf16:.2%}"
    )
    assert bf16 < start / 5  # the task is really learned
    assert abs(fp8 - bf16) / bf16 <= 0.05


def test_fp8_optimizer_states_keep_hyperparameters_and_groups():
    model = mlp()
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters()}],
        lr=1e-3,
        betas=(0.8, 0.9),
        weight_decay=0.05,
        eps=1e-7,
    )
    acc = ao_accelerator(optimizer_states="fp8")
    model, opt = acc.prepare(model, opt)
    from torchao.optim import AdamWFp8

    assert isinstance(opt.optimizer, AdamWFp8)
    groups = opt.param_groups
    assert [g["lr"] for g in groups] == [1e-2, 1e-3]
    assert groups[1]["betas"] == (0.8, 0.9) and groups[1]["weight_decay"] == 0.05 and groups[1]["eps"] == 1e-7
    assert sum(len(g["params"]) for g in groups) == 4


def _state_bytes_per_param(optimizer, params):
    state_bytes = 0
    for param in params:
        for value in optimizer.state[param].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                inner = (
                    [getattr(value, n) for n in value.__tensor_flatten__()[0]]
                    if hasattr(value, "__tensor_flatten__")
                    else [value]
                )
                state_bytes += sum(t.numel() * t.element_size() for t in inner)
    return state_bytes / sum(p.numel() for p in params)


def test_fp8_optimizer_states_use_at_most_2_5_bytes_per_parameter():
    x, y = regression_data(64)
    acc, model, opt, _ = _lowbit_training(2, x, y, optimizer_states="fp8")
    params = [p for p in model.parameters() if p.numel() >= 4096]  # torchao keeps tiny tensors in fp32
    fp8_bytes = _state_bytes_per_param(opt.optimizer, params)
    ref_model = mlp()
    ref = torch.optim.AdamW(ref_model.parameters())
    ref_model(x).sum().backward()
    ref.step()
    ref_params = [p for p in ref_model.parameters() if p.numel() >= 4096]
    fp32_bytes = _state_bytes_per_param(ref, ref_params)
    print(f"optimizer state bytes/param: AdamW fp32 {fp32_bytes:.2f}, AdamWFp8 {fp8_bytes:.2f}")
    assert fp32_bytes == 8.0 and fp8_bytes <= 2.5


def test_optimizers_it_cannot_convert_are_refused_by_name():
    model = mlp()
    with pytest.raises(UnsupportedCombinationError, match=r"torch.optim.sgd.SGD"):
        ao_accelerator(optimizer_states="fp8").prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_existing_adam_state_is_carried_over():
    from lowbit_ao.optim import to_low_bit_optimizer

    model = nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    low = to_low_bit_optimizer(opt, "fp8")
    old, new = opt.state[model.weight], low.state[model.weight]
    assert float(new["step"]) == float(old["step"]) == 1.0
    torch.testing.assert_close(new["exp_avg"].dequantize(), old["exp_avg"], atol=1e-3, rtol=0.1)


def test_save_model_loads_into_the_plain_model(tmp_path):
    x, y = regression_data(64)
    acc, model, _, _ = _lowbit_training(3, x, y)
    path = acc.save_model(model, tmp_path)
    plain = mlp(seed=7)
    plain.load_state_dict(load_file(path))
    torch.testing.assert_close(plain(x), acc.unwrap_model(model, keep_fp32_wrapper=False)(x), atol=0.2, rtol=0.1)
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_save_and_load_state_with_fp8_optimizer_states(tmp_path):
    x, y = regression_data(64)
    acc, model, opt, _ = _lowbit_training(3, x, y, optimizer_states="fp8")
    acc.save_state(tmp_path / "ckpt")
    acc2, model2, opt2, _ = _lowbit_training(0, x, y, optimizer_states="fp8")
    acc2.load_state(tmp_path / "ckpt")
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert float(opt2.state[model2[2].weight]["step"]) == 3.0


def test_torchao_missing_or_too_old_makes_ao_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setattr(lowbit_ao.importlib.metadata, "version", lambda name: "0.9.0")
    assert "torchao 0.9.0 is too old; lowbit-ao needs torchao >= 0.12" in lowbit_ao.unavailable_reason()
    with pytest.raises(BackendUnavailableError, match=r"too old"):
        ao_accelerator()
    monkeypatch.setattr(lowbit_ao.importlib.util, "find_spec", lambda name: None)
    assert lowbit_ao.unavailable_reason() == "torchao not installed: `pip install torchao`"


def test_a_torch_older_than_the_torchao_release_needs_makes_ao_unavailable_with_what_to_install(monkeypatch):
    """torchao 0.18 loads its kernels with torch >= 2.11 only (its own __init__ checks it); found at discovery."""
    versions = {"torchao": "0.18.0", "torch": "2.10.0+cu128"}
    monkeypatch.setattr(lowbit_ao.importlib.metadata, "version", lambda name: versions[name])
    assert lowbit_ao.unavailable_reason() == (
        "torchao 0.18.0 needs torch >= 2.11 (found torch 2.10.0+cu128): `pip install 'torch>=2.11'`, "
        "or the torchao built for your torch (`pip install 'torchao<0.18.0'`)"
    )
    versions["torch"] = "2.11.0+cu130"
    assert lowbit_ao.unavailable_reason() == ""


def test_torchao_start_up_noise_is_dropped_and_nothing_else():
    """torchao's GPU-kernel load failures and torch's Enum notices are harmless on a CPU machine;
    lowbit drops exactly those lines while it imports torchao, and keeps everything else."""
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "scripts" / "import_torchao.py"

    def stderr_of(*flags: str) -> list[str]:
        proc = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stderr.splitlines() if line.strip()]

    loud = stderr_of()
    quiet = stderr_of("--quiet")
    dropped = [line for line in loud if ("Failed to load" in line and "_C_" in line) or "is an Enum subclass" in line]
    assert not any(line in quiet for line in dropped)
    assert set(quiet) <= set(loud)  # nothing else was dropped, nothing new appeared


@pytest.mark.multiprocess
def test_the_gpu_ddp_worker_trains_on_two_cpu_processes():
    """ddp_worker.py, which test_ao_gpu.py launches on a GPU, runs here on CPU (same file, the device
    is the launcher's): a script only a GPU ran could break unseen (it once lacked an import)."""
    from ao_helpers import launch_ddp_worker

    result = launch_ddp_worker("--cpu", "--num_processes", "2")
    assert result["device"] == "cpu" and result["strategy"] == "ddp", result
    assert result["losses"][-1] < result["losses"][0] and result["report"].startswith("fp8 (ao"), result


def test_multi_gpu_with_one_process_trains_under_ddp():
    """``--multi_gpu --num_processes 1`` runs under torchrun and wraps DDP, as Accelerate does (the
    GPU test test_ddp_on_one_gpu_under_lowbit_launch failed on an H100 without it); here over gloo."""
    from ao_helpers import launch_ddp_worker

    result = launch_ddp_worker("--multi_gpu", "--num_processes", "1")
    assert result["device"] == "cpu" and result["strategy"] == "ddp", result


def test_float8_all_gather_of_row_scaled_weights_is_refused_naming_the_recipe_that_has_it():
    """torchao gathers only tensorwise-scaled weights in float8 (its config asserts otherwise)."""
    with pytest.raises(
        UnsupportedCombinationError, match=r"enable_fsdp_float8_all_gather=True needs.*recipe='tensorwise'"
    ):
        ao_accelerator(recipe="rowwise", enable_fsdp_float8_all_gather=True).prepare(mlp())
