"""lowbit-te against a stand-in transformer_engine (exact TE 2.20 signatures, real recipe module).

GPU tests at the end run only with CUDA sm_89+ and the real Transformer Engine.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("lowbit_te")

import torch  # noqa: E402
from helpers import HardwareDetector, TiedLM, needs_fp8_gpu_with, said  # noqa: E402
from safetensors.torch import load_file
from torch import nn  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.utils import TERecipeKwargs  # noqa: E402

from lowbit.kernel.errors import BackendUnavailableError, ConfigError, UnsupportedCombinationError  # noqa: E402
from lowbit.kernel.registry import PluginRegistry, choose_plugin  # noqa: E402
from lowbit.kernel.types import HardwareInfo  # noqa: E402

from lowbit.run.plugin_manager import make_plugin_manager  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import source_signatures  # noqa: E402
import standin_te  # noqa: E402
import te_sources  # noqa: E402

TE_VERSION = "2.20.2"
H100 = HardwareInfo("cpu", "stand-in NVIDIA H100 (tensors on CPU)", 1, (9, 0), (12, 9))
B200 = HardwareInfo("cpu", "stand-in NVIDIA B200 (tensors on CPU)", 1, (10, 0), (12, 9))
A100 = HardwareInfo("cuda", "NVIDIA A100", 1, (8, 0))


@pytest.fixture(scope="session")
def te_source() -> Path:
    """TE's Python sources, from the transformer-engine wheel on PyPI (cached between runs)."""
    return te_sources.te_source(TE_VERSION)


@pytest.fixture(scope="session")
def real_recipe(te_source):
    spec = importlib.util.spec_from_file_location(
        "transformer_engine.common.recipe", te_source / "common" / "recipe" / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["transformer_engine.common.recipe"] = module  # pydantic dataclasses resolve names through here
    spec.loader.exec_module(module)
    del sys.modules["transformer_engine.common.recipe"]
    return module


@pytest.fixture
def te(monkeypatch, real_recipe):
    for name, module in standin_te.install(real_recipe).items():
        monkeypatch.setitem(sys.modules, name, module)
    standin_te.AUTOCAST_CALLS.clear()
    return sys.modules["transformer_engine.pytorch"]


def te_accelerator(hardware=H100, **recipe):
    manager = make_plugin_manager(extra_plugins=[HardwareDetector(hardware)])
    return Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(**recipe)], plugin_manager=manager)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.rms = nn.RMSNorm(64)
        # Linear(64, 40) suits TE's FP8 GEMM (in % 16, out % 8); Linear(40, 64) does not (in 40).
        self.block = nn.Sequential(nn.Linear(64, 64, bias=False), nn.GELU(), nn.Linear(64, 40), nn.Linear(40, 64))
        self.out = nn.Linear(64, 16)

    def forward(self, x):
        return self.out(self.block(self.rms(self.norm(self.inp(x)))))


# ------------------------------------------------------------------ the stand-in is faithful


def _real_signature(path: Path, qualname: str) -> list[tuple[str, str | None]]:
    tree = ast.parse(path.read_text())
    cls_name, _, func_name = qualname.rpartition(".")
    scope = tree.body
    if cls_name:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name).body
    func = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == func_name)
    return source_signatures.parameters_with_defaults(func.args)


@pytest.mark.parametrize(
    "path, qualname, standin",
    [
        ("pytorch/module/linear.py", "Linear.__init__", standin_te.Linear.__init__),
        ("pytorch/module/layernorm.py", "LayerNorm.__init__", standin_te.LayerNorm.__init__),
        ("pytorch/module/rmsnorm.py", "RMSNorm.__init__", standin_te.RMSNorm.__init__),
        ("pytorch/quantization.py", "autocast.__init__", standin_te.autocast.__init__),
        ("pytorch/quantization.py", "fp8_autocast", standin_te.fp8_autocast),
        ("pytorch/quantization.py", "is_fp8_available", standin_te.is_fp8_available),
        ("pytorch/quantization.py", "is_mxfp8_available", standin_te.is_mxfp8_available),
        ("pytorch/quantization.py", "is_fp8_block_scaling_available", standin_te.is_fp8_block_scaling_available),
        ("pytorch/quantization.py", "is_nvfp4_available", standin_te.is_nvfp4_available),
        ("pytorch/distributed.py", "checkpoint", standin_te.checkpoint),
    ],
)
def test_standin_signatures_match_the_real_te(te_source, path, qualname, standin):
    assert source_signatures.parameters_of(standin) == _real_signature(te_source / path, qualname)


PLUGIN_DIR = Path(importlib.util.find_spec("lowbit_te").origin).parent


@pytest.mark.parametrize("version", te_sources.SUPPORTED_VERSIONS)
def test_every_te_call_of_the_plugin_binds_to_that_te_release(version):
    """Each ``te.NAME(...)`` in lowbit-te's source names something ``transformer_engine.pytorch``
    exports in that release, and its positional count and keywords bind to the real parameters."""
    root = te_sources.te_source(version)
    calls = te_sources.te_calls(PLUGIN_DIR)
    assert {name for name, *_ in calls} >= {"Linear", "LayerNorm", "RMSNorm", "autocast", "is_fp8_available"}
    for name, positional, keywords, where in calls:
        node = source_signatures.find_definition(root, "transformer_engine.pytorch", name)
        assert node is not None, f"{where}: te.{name} does not exist in transformer_engine.pytorch {version}"
        real = source_signatures.signature(source_signatures.callable_args(node))
        try:
            real.bind(*range(positional), **dict.fromkeys(keywords))
        except TypeError as exc:
            pytest.fail(
                f"{where}: te.{name}({positional} positional, {', '.join(keywords)}) does not fit "
                f"TE {version}'s {name}{real}: {exc}"
            )


def test_the_call_reader_sees_a_call_that_does_not_fit(tmp_path):
    """The check above can fail: a keyword TE does not have, and a name TE does not export."""
    (tmp_path / "bad.py").write_text("def f(te):\n    te.Linear(1, 2, bais=True)\n    te.fp8_magic()\n")
    root = te_sources.te_source(TE_VERSION)
    (name, positional, keywords, _), (missing, *_rest) = te_sources.te_calls(tmp_path)
    real = source_signatures.signature(
        source_signatures.callable_args(source_signatures.find_definition(root, "transformer_engine.pytorch", name))
    )
    with pytest.raises(TypeError, match="bais"):
        real.bind(*range(positional), **dict.fromkeys(keywords))
    assert source_signatures.find_definition(root, "transformer_engine.pytorch", missing) is None


# ------------------------------------------------------------------ availability and ranking


def test_unavailable_on_cpu_and_without_te_with_precise_reasons(te, monkeypatch):
    import lowbit_te

    cpu = "Transformer Engine needs CUDA (a GPU with compute capability >= 8.9); found CPU"
    assert lowbit_te.unavailable_reason(HardwareInfo("cpu", "CPU")) == cpu
    assert "found NVIDIA A100 (sm_80)" in lowbit_te.unavailable_reason(A100)
    assert lowbit_te.unavailable_reason(H100) == ""
    monkeypatch.setattr(lowbit_te.importlib.util, "find_spec", lambda name: None)
    assert lowbit_te.unavailable_reason(H100).startswith("transformer_engine not importable")
    # On a CPU the hardware comes first: installing TE would not help there.
    assert (
        lowbit_te.unavailable_reason(HardwareInfo("cpu", "CPU"))
        == cpu + " (and it is not installed: " + lowbit_te.INSTALL + ")"
    )


def test_te_without_its_pytorch_extension_or_with_mixed_versions_is_unavailable(te, monkeypatch):
    """PyPI's transformer-engine alone (1.2 MB) cannot import transformer_engine.pytorch: it ranks
    below ao instead of winning and failing in prepare()."""
    import lowbit_te

    extension = sys.modules["transformer_engine_torch"]
    monkeypatch.delitem(sys.modules, "transformer_engine_torch")
    reason = lowbit_te.unavailable_reason(H100)
    assert "without its PyTorch extension (transformer_engine_torch)" in reason
    assert choose_plugin(PluginRegistry(make_plugin_manager(), H100), "backend").name != "te"
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", extension)
    versions = {"transformer_engine": "2.20.2", "transformer_engine_torch": "2.19.0"}
    monkeypatch.setattr(lowbit_te, "installed_version", lambda name: versions.get(name))
    assert "transformer_engine 2.20.2 and transformer_engine_torch 2.19.0 differ" in lowbit_te.unavailable_reason(H100)
    versions["transformer_engine_torch"] = "2.20.2"
    assert lowbit_te.unavailable_reason(H100) == ""


def test_old_te_version_is_named(te, monkeypatch):
    import lowbit_te

    monkeypatch.setattr(lowbit_te, "installed_version", lambda name: "2.8.0")
    monkeypatch.setattr(lowbit_te.importlib.metadata, "version", lambda name: "2.8.0")
    reason = lowbit_te.unavailable_reason(H100)
    assert "transformer_engine 2.8.0 is older than the supported 2.9" in reason and "pip install -U" in reason


def test_te_priority_200_beats_ao(te):
    registry = PluginRegistry(make_plugin_manager(), H100)
    assert choose_plugin(registry, "backend").name == "te"
    assert registry.find("backend", "te").description.priority == 200


def test_forcing_te_on_cpu_is_a_clear_error(te):
    with pytest.raises(
        BackendUnavailableError, match=r"'te'.*needs CUDA \(a GPU with compute capability >= 8.9\); found CPU"
    ):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs()])


# ------------------------------------------------------------------ conversion


def test_layers_converted_and_skipped_with_reasons_and_weights_copied(te):
    torch.manual_seed(0)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    acc = te_accelerator()
    with pytest.warns(UserWarning, match=r"1 Linear layer\(s\) kept in high precision.*block.3"):
        prepared = acc.prepare(model)
    report = acc._run.prepared.conversion_reports[prepared]
    assert set(report.converted) == {"inp", "norm", "rms", "block.0", "block.2", "out"}
    assert report.skipped == {"block.3": "dims 40x64: TE's FP8 GEMMs need in_features % 16 and out_features % 8"}
    assert isinstance(prepared.block[2], standin_te.Linear)  # 64 -> 40: out 40 is a multiple of 8
    assert (
        isinstance(prepared.block[0], standin_te.Linear) and prepared.block[0].bias.numel() == 0
    )  # TE: empty, not None
    assert isinstance(prepared.block[3], nn.Linear)
    after = prepared.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
        assert after[key].dtype == value.dtype and after[key].device == value.device


def test_keep_first_last_in_high_precision(te):
    prepared = te_accelerator(keep_first_last_high_precision=True).prepare(Net())
    assert type(prepared.inp) is nn.Linear and type(prepared.out) is nn.Linear
    assert isinstance(prepared.block[0], standin_te.Linear)


def test_model_with_te_modules_is_left_as_is(te):
    model = nn.Sequential(standin_te.Linear(16, 16, device="cpu"), nn.Linear(16, 16))
    acc = te_accelerator()
    prepared = acc.prepare(model)
    assert type(prepared[1]) is nn.Linear  # untouched: the user built the model with TE already
    assert prepared not in acc._run.prepared.conversion_reports and acc.fp8_report() is None


def test_optimizer_follows_the_new_parameters(te):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, opt = te_accelerator().prepare(model, opt)
    optimizer_params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert optimizer_params == {id(p) for p in prepared.parameters()}


def test_model_only_prepare_works(te):
    assert isinstance(te_accelerator().prepare(Net()).inp, standin_te.Linear)


def test_tied_weights_stay_tied_and_train(te, tmp_path):
    acc = te_accelerator()
    model = TiedLM(vocab=64, width=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    assert isinstance(model.head, standin_te.Linear) and model.head.weight is model.embed.weight
    before = model.embed.weight.detach().clone()
    ids = torch.randint(0, 64, (4, 8))
    acc.backward(nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten()))
    optimizer.step()
    assert model.head.weight is model.embed.weight and not torch.equal(model.embed.weight, before)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters()
    )
    state = load_file(acc.save_model(model, tmp_path))
    assert "head.weight" not in state or "embed.weight" not in state  # one tensor for the tied pair


def test_rmsnorm_without_eps_keeps_torchs_epsilon(te):
    """nn.RMSNorm(eps=None) uses the op-math type's epsilon (fp32's for bf16); TE needs a number."""
    norm = nn.RMSNorm(64, eps=None, dtype=torch.bfloat16)
    model = te_accelerator().prepare(nn.Sequential(nn.Linear(64, 64, dtype=torch.bfloat16), norm))
    assert model[1].eps == torch.finfo(torch.float32).eps
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 1e-2
    assert torch.equal(model[1](x), norm(x))


# ------------------------------------------------------------------ recipes


@pytest.mark.parametrize("scaling", ["block", "mxfp8"])
def test_block_recipes_keep_tes_e4m3_default_unless_a_format_is_given(te, real_recipe, monkeypatch, scaling):
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setitem(standin_te.CAPABILITY, "mxfp8", (True, ""))
    from lowbit_te.runtime import build_recipe

    assert build_recipe(te_accelerator(B200, recipe=scaling)._run.context).fp8_format is real_recipe.Format.E4M3
    assert (
        build_recipe(te_accelerator(B200, recipe=scaling, fp8_format="HYBRID")._run.context).fp8_format
        is real_recipe.Format.HYBRID
    )


@pytest.mark.parametrize("option", [{"margin": 1}, {"amax_history_len": 16}, {"amax_compute_algo": "max"}])
def test_delayed_scaling_options_with_another_recipe_are_an_error(te, option):
    from lowbit_te.runtime import build_recipe

    with pytest.raises(
        ConfigError, match=f"{next(iter(option))}=.*recipe='current'.*Float8CurrentScaling has no such option"
    ):
        build_recipe(te_accelerator(recipe="current", **option)._run.context)


@pytest.mark.parametrize("explicit", [{}, {"amax_compute_algo": "most_recent", "margin": 0}])
def test_every_delayed_scaling_field_reaches_te(te, real_recipe, explicit):
    acc = te_accelerator(**explicit, fp8_format="E4M3", amax_history_len=16)
    model = acc.prepare(Net())
    model(torch.randn(2, 32))
    recipe = standin_te.AUTOCAST_CALLS[-1]["recipe"]
    assert type(recipe) is real_recipe.DelayedScaling
    assert recipe.fp8_format is real_recipe.Format.E4M3
    assert (recipe.margin, recipe.amax_history_len, recipe.amax_compute_algo) == (0, 16, "most_recent")


@pytest.mark.parametrize("name, cls", [("current", "Float8CurrentScaling"), ("block", "Float8BlockScaling")])
def test_current_recipes(te, real_recipe, name, cls, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.9")  # block scaling needs CUDA >= 12.9 (this CPU build has none)
    model = te_accelerator(recipe=name, fp8_format="E4M3").prepare(Net())
    model(torch.randn(2, 32))
    recipe = standin_te.AUTOCAST_CALLS[-1]["recipe"]
    assert type(recipe) is getattr(real_recipe, cls) and recipe.fp8_format is real_recipe.Format.E4M3


def test_mxfp8_needs_blackwell(te, real_recipe, monkeypatch):
    with pytest.raises(
        BackendUnavailableError,
        match=r"mxfp8 needs a GPU with compute capability >= 10.0 \(Blackwell\); "
        r"found stand-in NVIDIA H100.*sm_90.*backend 'te'",
    ):
        te_accelerator(recipe="mxfp8").prepare(Net())
    with pytest.raises(
        BackendUnavailableError, match=r"Transformer Engine cannot run recipe='mxfp8'.*stand-in verdict"
    ):
        te_accelerator(B200, recipe="mxfp8").prepare(Net())  # TE's own verdict counts too (it refuses sm_120)
    monkeypatch.setitem(standin_te.CAPABILITY, "mxfp8", (True, ""))
    model = te_accelerator(B200, recipe="mxfp8", margin=2, fp8_format="E4M3").prepare(Net())
    model(torch.randn(2, 32))
    recipe = standin_te.AUTOCAST_CALLS[-1]["recipe"]
    assert type(recipe) is real_recipe.MXFP8BlockScaling and recipe.margin == 2


def test_block_scaling_needs_hopper_and_cuda_12_9_at_prepare(te, real_recipe, monkeypatch):
    """TE itself finds this out at the first forward; lowbit says it at prepare()."""
    ada = HardwareInfo("cpu", "stand-in NVIDIA L4 (tensors on CPU)", 1, (8, 9), (12, 9))
    with pytest.raises(
        BackendUnavailableError,
        match=r"block needs a GPU with compute capability >= 9.0 \(Hopper, Blackwell\) "
        r"and CUDA >= 12.9; found .*sm_89",
    ):
        te_accelerator(ada, recipe="block").prepare(Net())
    old_cuda = HardwareInfo("cpu", "stand-in NVIDIA H100 (tensors on CPU)", 1, (9, 0), (12, 4))
    with pytest.raises(BackendUnavailableError, match=r"with CUDA 12.4"):
        te_accelerator(old_cuda, recipe="block").prepare(Net())
    model = te_accelerator(recipe="block").prepare(Net())
    model(torch.randn(2, 32))
    assert type(standin_te.AUTOCAST_CALLS[-1]["recipe"]) is real_recipe.Float8BlockScaling


def test_delayed_scaling_under_torch_compile_is_refused_at_prepare(te):
    manager = make_plugin_manager(extra_plugins=[HardwareDetector(H100)])
    acc = Accelerator(
        mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs()], dynamo_backend="eager", plugin_manager=manager
    )
    with pytest.raises(UnsupportedCombinationError, match="DelayedScaling.*torch.compile.*recipe='current'"):
        acc.prepare(Net())
    current = Accelerator(
        mixed_precision="fp8",
        kwargs_handlers=[TERecipeKwargs(recipe="current")],
        dynamo_backend="eager",
        plugin_manager=manager,
    )
    current.prepare(Net())


def test_user_built_recipe_is_passed_as_is(te, real_recipe):
    mine = real_recipe.Float8CurrentScaling()
    model = te_accelerator(te_recipe=mine).prepare(Net())
    model(torch.randn(2, 32))
    assert standin_te.AUTOCAST_CALLS[-1]["recipe"] is mine


def test_removed_te1_options_error_when_they_would_change_behaviour(te):
    te_accelerator(interval=1, override_linear_precision=(False, False, False)).prepare(Net())  # TE 2.x behaviour: fine
    with pytest.raises(ConfigError, match=r"interval=4 cannot reach this Transformer Engine"):
        te_accelerator(interval=4).prepare(Net())
    with pytest.raises(ConfigError, match=r"override_linear_precision"):
        te_accelerator(override_linear_precision=(True, False, False)).prepare(Net())


def test_bad_format_and_algo_are_named():
    with pytest.raises(ConfigError, match=r"'E3M4'.*Valid: E4M3, E5M2, HYBRID"):
        TERecipeKwargs(fp8_format="E3M4")
    with pytest.raises(ConfigError, match=r"'maximum'.*Valid: max, most_recent"):
        TERecipeKwargs(amax_compute_algo="maximum")


def test_pure_e5m2_is_refused_before_te_asserts(te):
    with pytest.raises(ConfigError, match=r"E5M2.*not supported by Transformer Engine"):
        te_accelerator(fp8_format="E5M2").prepare(Net())


def test_options_from_yaml_env_and_launch_flags(te, tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text(
        "mixed_precision: fp8\nfp8_config:\n  backend: TE\n  fp8_format: E4M3\n  amax_history_len: 32\n"
        "  amax_compute_algo: max\n  override_linear_precision: (false, false, false)\n"
    )
    manager = make_plugin_manager(extra_plugins=[HardwareDetector(H100)])
    acc = Accelerator(config_file=path, plugin_manager=manager)
    assert acc.fp8_backend == "te"
    assert (acc.fp8_options.fp8_format, acc.fp8_options.amax_history_len, acc.fp8_options.amax_compute_algo) == (
        "E4M3",
        32,
        "max",
    )
    monkeypatch.setenv("LOWBIT_FP8_AMAX_HISTORY_LEN", "64")
    assert Accelerator(config_file=path, plugin_manager=manager).fp8_options.amax_history_len == 64
    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    script = tmp_path / "s.py"
    script.write_text("")
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    args = build_parser().parse_args(
        ["launch", "--mixed_precision", "fp8", "--fp8_format", "E4M3", "--fp8_amax_history_len", "8", str(script)]
    )
    _, env, _ = build_command(args)
    assert env["LOWBIT_FP8_FORMAT"] == "E4M3" and env["LOWBIT_FP8_AMAX_HISTORY_LEN"] == "8"


# ------------------------------------------------------------------ autocast


def test_te_autocast_runs_inside_native_bf16_autocast(te):
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(
                (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), len(standin_te.AUTOCAST_CALLS))
            )
            return x

    model = nn.Sequential(nn.Linear(16, 16), Probe())
    model = te_accelerator().prepare(model)
    model(torch.randn(2, 16))
    assert seen == [(True, torch.bfloat16, 1)]  # inside bf16 autocast, after TE's autocast was entered
    record = standin_te.AUTOCAST_CALLS[-1]
    assert record["enabled"] and record["api"] == "autocast" and record["amax_reduction_group"] is None


def test_eval_turns_te_autocast_off_unless_asked(te):
    model = te_accelerator().prepare(Net())
    model.eval()
    model(torch.randn(2, 32))
    assert standin_te.AUTOCAST_CALLS == []
    model = te_accelerator(use_autocast_during_eval=True).prepare(Net())
    model.eval()
    model(torch.randn(2, 32))
    assert len(standin_te.AUTOCAST_CALLS) == 1


# ------------------------------------------------------------------ checkpoints


def test_save_model_maps_back_to_plain_names_without_fp8_metadata(te, tmp_path):
    acc = te_accelerator()
    model = acc.prepare(Net())
    assert any(k.endswith("_extra_state") for k in model.state_dict())
    path = acc.save_model(model, tmp_path)
    state = load_file(path)
    assert not any(k.endswith("_extra_state") for k in state)
    Net().load_state_dict(state)  # strict: every name matches the plain model


def _trained_te(acc, steps: int = 2, model_class: type | None = None):
    """A ``model_class`` (default Net) prepared with AdamW by ``acc`` and trained ``steps`` steps."""
    torch.manual_seed(0)
    model = (model_class or Net)()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    for _ in range(steps):
        acc.backward(model(torch.randn(8, 32)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _amax_histories(model):
    return {
        name: m.fp8_meta["scaling_fwd"].amax_history.clone()
        for name, m in model.named_modules()
        if isinstance(m, standin_te.Linear) and "scaling_fwd" in m.fp8_meta
    }


@pytest.mark.parametrize("release", ["2.20.2", "2.9.0"])
def test_save_state_round_trips_fp8_state_without_pickle(te, tmp_path, monkeypatch, release):
    """TE pickles its recipe into _extra_state: 2.20 refuses to load that, 2.9 runs the pickle.
    lowbit keeps _extra_state empty and writes the scaling state as plain tensors."""
    monkeypatch.setitem(standin_te.RELEASE, "version", release)
    acc = te_accelerator()
    model, _ = _trained_te(acc)
    acc.save_state(tmp_path / "ckpt")
    saved = _amax_histories(model)
    assert saved and all(h.abs().sum() > 0 for h in saved.values())
    written = torch.load(tmp_path / "ckpt" / "model_0.pt", weights_only=True)
    assert all(v.numel() == 0 for k, v in written.items() if k.endswith("_extra_state"))
    assert set(torch.load(tmp_path / "ckpt" / "fp8_state_0.pt", weights_only=True)) == set(saved)

    monkeypatch.setattr(standin_te.pickle, "loads", lambda data: pytest.fail("checkpoint data was unpickled"))
    fresh_acc = te_accelerator()
    fresh = fresh_acc.prepare(Net())  # never run a forward: TE has no FP8 state yet
    fresh_acc.load_state(tmp_path / "ckpt")
    restored = _amax_histories(fresh)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    fresh(torch.randn(8, 32))  # the first forward keeps the restored state (same recipe object)
    assert torch.equal(fresh.inp.fp8_meta["scaling_fwd"].amax_history[1:], saved["inp"][1:])


def test_a_save_after_an_eval_pass_keeps_the_amax_history(te, tmp_path):
    acc = te_accelerator()
    model, _ = _trained_te(acc)
    model.eval()
    model(torch.randn(8, 32))  # outside FP8 autocast: TE's own extra state would now be empty
    assert model.inp.get_extra_state().numel() == 0
    acc.save_state(tmp_path / "ckpt")
    state = torch.load(tmp_path / "ckpt" / "fp8_state_0.pt", weights_only=True)
    assert torch.equal(state["inp"]["amax_history_fwd"], _amax_histories(model)["inp"])


def test_a_checkpoint_with_pickled_te_state_loads_without_unpickling(te):
    from lowbit_te.fp8_state import without_pickled_extra_state

    state = {
        "inp.weight": torch.ones(2),
        "inp._extra_state": torch.frombuffer(bytearray(b"\x80\x04N."), dtype=torch.uint8),
    }
    with pytest.warns(UserWarning, match="does not unpickle"):
        cleaned = without_pickled_extra_state(state)
    assert cleaned["inp._extra_state"].numel() == 0 and torch.equal(cleaned["inp.weight"], state["inp.weight"])
    assert without_pickled_extra_state({"inp._extra_state": torch.empty(0, dtype=torch.uint8)}) is None


# ------------------------------------------------------------------ what TE refuses on a GPU


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("scaling, hardware", [("delayed", H100), ("mxfp8", B200), ("nvfp4", B200)])
def test_odd_token_counts_are_padded_for_te(te, monkeypatch, scaling, hardware):
    monkeypatch.setitem(standin_te.CAPABILITY, "mxfp8", (True, ""))
    monkeypatch.setitem(standin_te.CAPABILITY, "nvfp4", (True, ""))
    manager = make_plugin_manager(extra_plugins=[HardwareDetector(hardware)])
    acc = Accelerator(
        mixed_precision="fp4" if scaling == "nvfp4" else "fp8",
        plugin_manager=manager,
        kwargs_handlers=[TERecipeKwargs(recipe=scaling, keep_first_last_high_precision=False, fp4_last_layers_bf16=0)],
    )
    reference = TokenNet()
    model = acc.prepare(TokenNet())
    x = torch.randn(3, 11, 64)
    out = model(x)  # 33 tokens: TE's FP8 GEMM takes multiples of 8 (MXFP8: 32)
    assert out.shape == (3, 11, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(out, reference(x))
    out.sum().backward()
    assert model.a.weight.grad is not None
    multiple = {"mxfp8": 32, "nvfp4": 16}.get(scaling, 8)
    assert f"padded to a multiple of {multiple}" in acc.fp8_report()


def test_without_padding_te_refuses_odd_token_counts_as_on_a_gpu(te):
    model = te_accelerator(pad_tokens=False).prepare(TokenNet())
    with pytest.raises(ValueError, match="33 rows"):
        model(torch.randn(3, 11, 64))
    model(torch.randn(4, 8, 64))


def test_mxfp8_keeps_layers_whose_dims_are_not_multiples_of_32(te, monkeypatch):
    monkeypatch.setitem(standin_te.CAPABILITY, "mxfp8", (True, ""))
    with pytest.warns(
        UserWarning, match=r"block.2 \(dims 64x40: TE's FP8 GEMMs need in_features % 32 and out_features % 32\)"
    ):
        model = te_accelerator(B200, recipe="mxfp8").prepare(Net())
    assert type(model.block[2]) is nn.Linear
    model(torch.randn(32, 32))


# ------------------------------------------------------------------ real GPU


@needs_fp8_gpu_with("transformer_engine.pytorch", "Transformer Engine")
def test_gpu_one_step_loss_matches_bf16(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    losses = {}
    for precision in ("bf16", "fp8"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
        handlers = [TERecipeKwargs()] if precision == "fp8" else []
        acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers)
        model = acc.prepare(model)
        losses[precision] = nn.functional.mse_loss(model(x), y).item()
        if precision == "fp8":
            path = acc.save_model(model, tmp_path)
            plain = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
            plain.load_state_dict(load_file(path))
    assert abs(losses["fp8"] - losses["bf16"]) / losses["bf16"] < 0.05


def test_amax_reduction_group_is_the_data_parallel_group(te):
    import torch.distributed as dist

    from lowbit_te.runtime import fp8_autocast_factory

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    acc = te_accelerator()
    two_processes = dataclasses.replace(acc._run.context, world_size=2)  # as under a 2-process launch
    with fp8_autocast_factory(None, two_processes)():
        pass
    assert standin_te.AUTOCAST_CALLS[-1]["amax_reduction_group"] is dist.group.WORLD


def test_the_conformance_kit_passes_on_the_te_stand_in(te, tmp_path):
    """Through the installed entry point, on a stand-in H100 (tensors stay on the CPU)."""
    from lowbit.conformance import run_conformance

    report = run_conformance("te", heavy_modules=("transformer_engine",), hardware=H100, tmp_path=tmp_path)
    assert report["converted"] and report["weight_change"] == 0.0


# ------------------------------------------------------------------ NVFP4 (TE 2.8+)


def fp4_accelerator(hardware=B200, **options):
    manager = make_plugin_manager(extra_plugins=[HardwareDetector(hardware)])
    return Accelerator(mixed_precision="fp4", kwargs_handlers=[TERecipeKwargs(**options)], plugin_manager=manager)


def test_fp4_builds_tes_nvfp4_recipe_with_nvidias_defaults(te, real_recipe, monkeypatch):
    monkeypatch.setitem(standin_te.CAPABILITY, "nvfp4", (True, ""))
    acc = fp4_accelerator()
    assert acc.fp8_options.recipe == "nvfp4"  # fp4's default recipe on TE, not the fp8 default 'delayed'
    model = acc.prepare(Net())
    model(torch.randn(16, 32)).sum().backward()
    recipe = standin_te.AUTOCAST_CALLS[-1]["recipe"]
    assert type(recipe) is real_recipe.NVFP4BlockScaling
    assert (recipe.disable_rht, recipe.disable_stochastic_rounding, recipe.disable_2d_quantization) == (
        False,
        False,
        False,
    )
    assert acc.fp8_report().startswith("fp4 (te, nvfp4): ")


def test_nvfp4_options_reach_te_as_its_disable_switches(te, real_recipe, monkeypatch):
    monkeypatch.setitem(standin_te.CAPABILITY, "nvfp4", (True, ""))
    from lowbit_te.runtime import build_recipe

    recipe = build_recipe(
        fp4_accelerator(
            nvfp4_random_hadamard=False, nvfp4_stochastic_rounding=False, nvfp4_2d_weight_scaling=False
        )._run.context
    )
    assert (recipe.disable_rht, recipe.disable_stochastic_rounding, recipe.disable_2d_quantization) == (
        True,
        True,
        True,
    )
    with pytest.raises(ConfigError, match="fp8_format='HYBRID' cannot reach Transformer Engine with recipe='nvfp4'"):
        build_recipe(fp4_accelerator(fp8_format="HYBRID")._run.context)


def test_tes_own_nvfp4_switches_hold_unless_a_lowbit_option_is_given(te_source, monkeypatch, recwarn):
    """TE reads NVTE_NVFP4_DISABLE_* into NVFP4BlockScaling's defaults when its recipe module is
    imported (common/recipe/__init__.py, 2.9.0 and 2.20.2); lowbit passed its own defaults over them."""
    from lowbit_te.runtime import build_recipe

    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "1")
    spec = importlib.util.spec_from_file_location(
        "transformer_engine.common.recipe", te_source / "common" / "recipe" / "__init__.py"
    )
    recipe_module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe_module)
    spec.loader.exec_module(recipe_module)  # imported with the variables set, as on the user's machine
    for name, module in standin_te.install(recipe_module).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(standin_te.CAPABILITY, "nvfp4", (True, ""))

    recipe = build_recipe(fp4_accelerator()._run.context)
    assert (recipe.disable_rht, recipe.disable_stochastic_rounding, recipe.disable_2d_quantization) == (
        True,
        True,
        False,
    )
    assert "overrides" not in said(recwarn)
    # the user's option wins, and says so
    recipe = build_recipe(fp4_accelerator(nvfp4_random_hadamard=True)._run.context)
    assert (recipe.disable_rht, recipe.disable_stochastic_rounding) == (False, True)
    assert "nvfp4_random_hadamard=True overrides NVTE_NVFP4_DISABLE_RHT=1" in said(recwarn)


def test_fp4_keeps_the_last_linears_in_bf16(te, monkeypatch):
    monkeypatch.setitem(standin_te.CAPABILITY, "nvfp4", (True, ""))
    acc = fp4_accelerator(fp4_last_layers_bf16=0.4)
    model = acc.prepare(Net())
    # Net's Linears: inp, block.0, block.2 (dims 64x40: not NVFP4's 16x16), block.3, out.
    te_linears = [
        n
        for n, m in model.named_modules()
        if type(m).__name__ == "Linear" and type(m).__module__.startswith("transformer_engine")
    ]
    assert te_linears == ["inp", "block.0"]  # TE keeps the first and last by choice only
    report = acc.fp8_report()
    assert "block.3 (in the last 40% of Linears, kept in bf16 (fp4_last_layers_bf16))" in report


def test_fp4_on_hopper_names_the_hardware_it_needs(te):
    with pytest.raises(
        BackendUnavailableError,
        match=r"nvfp4 needs a GPU with compute capability >= 10.0 \(Blackwell\); found stand-in NVIDIA H100",
    ):
        fp4_accelerator(H100)


def test_nvfp4_under_fp8_is_a_clear_error(te):
    with pytest.raises(
        ConfigError, match=r"recipe 'nvfp4' \(from TERecipeKwargs\) trains in 'fp4'.*Set mixed_precision='fp4'"
    ):
        te_accelerator(B200, recipe="nvfp4")


# ------------------------------------------------------------------ resuming what TE keeps per process


class RecomputedNet(Net):
    """Net with its block under TE's activation recompute, as a memory-bound TE script writes it."""

    def forward(self, x):
        recompute = sys.modules["transformer_engine.pytorch"].distributed.checkpoint
        return self.out(recompute(self.block, self.rms(self.norm(self.inp(x)))))


def test_resume_after_activation_recompute_starts_a_fresh_recompute_buffer(te, tmp_path):
    """TE keeps each module's slot in a per-process buffer in fp8_meta; its set_extra_state drops it
    (module/base.py 2.9.0 and 2.20.2). Restored, the slot points past a new process's empty buffer."""
    RECOMPUTE_BUFFER_KEY = standin_te.RECOMPUTE_KEY  # TE's fp8_meta key for the slot

    acc = te_accelerator(recipe="delayed")
    model, _ = _trained_te(acc, model_class=RecomputedNet)
    assert any(RECOMPUTE_BUFFER_KEY in m.fp8_meta for m in model.modules() if isinstance(m, standin_te.Linear))
    acc.save_state(tmp_path / "ckpt")

    standin_te.RECOMPUTE_BUFFER.clear()  # the resuming process: TE's buffer starts empty
    fresh_acc = te_accelerator(recipe="delayed")
    fresh, _ = _trained_te(fresh_acc, steps=0, model_class=RecomputedNet)
    fresh_acc.load_state(tmp_path / "ckpt")
    loss = fresh(torch.randn(8, 32)).pow(2).mean()
    fresh_acc.backward(loss)  # the recompute in backward reads the slot the forward just made
    assert torch.isfinite(loss) and all(p.grad is not None for p in fresh.parameters() if p.requires_grad)
    saved = torch.load(tmp_path / "ckpt" / "fp8_state_0.pt", weights_only=True)
    assert saved and not any(RECOMPUTE_BUFFER_KEY in entry["extra_fp8_variables"] for entry in saved.values())


def test_resume_under_another_te_recipe_loads_and_says_the_histories_are_dropped(te, tmp_path, recwarn):
    """Saved under delayed scaling, resumed under current scaling (which keeps no amax history):
    before, an AttributeError from inside TE's state; now the weights load and a note says why the
    histories do not. The checkpoint records the recipe it was saved with."""
    from lowbit.runtime.checkpoint.files import read_metadata

    acc = te_accelerator(recipe="delayed")
    model, _ = _trained_te(acc)
    acc.save_state(tmp_path / "ckpt")
    assert read_metadata(tmp_path / "ckpt")["recipe"] == "delayed"
    fresh_acc = te_accelerator(recipe="current")
    fresh, _ = _trained_te(fresh_acc, steps=0)
    fresh_acc.load_state(tmp_path / "ckpt")
    assert "holds delayed-scaling state" in said(recwarn) and "are not restored" in said(recwarn)
    for (name, saved), restored in zip(
        acc.unwrap_model(model).state_dict().items(), acc.unwrap_model(fresh).state_dict().values()
    ):
        if not name.endswith("_extra_state"):
            assert torch.equal(saved, restored), name
    fresh_acc.backward(fresh(torch.randn(8, 32)).pow(2).mean())  # and trains on under the new recipe


# ------------------------------------------------------------------ activation checkpointing


@pytest.mark.parametrize("recompute", ["te", "torch"])
def test_checkpointed_blocks_recompute_in_fp8_through_tes_own_checkpoint(te, monkeypatch, recompute):
    """The strategies' activation checkpointing recomputes with what the backend gives: lowbit-te
    gives te.distributed.checkpoint, which runs the recompute (in backward, outside te.autocast)
    under the forward's FP8 settings; torch's checkpoint would recompute that block in high precision."""
    from lowbit.runtime.builtin.activation_checkpointing import checkpoint_blocks

    import lowbit_te

    acc = te_accelerator(recipe="delayed")
    torch.manual_seed(0)
    model = acc.prepare(Net())
    seen: dict[str, list[bool]] = {"forward": [], "backward": []}
    phase = ["forward"]
    forward = standin_te.Linear.forward
    monkeypatch.setattr(
        standin_te.Linear,
        "forward",
        lambda self, x: (seen[phase[0]].append(standin_te.FP8_STATE["enabled"]), forward(self, x))[1],
    )
    given = lowbit_te.strategy_integration(strategy="fsdp", context=acc._run.context).activation_checkpoint
    checkpoint_blocks(
        acc.unwrap_model(model), [acc.unwrap_model(model).block], "full", given if recompute == "te" else None
    )
    loss = model(torch.randn(8, 32)).pow(2).mean()
    phase[0] = "backward"
    acc.backward(loss)
    assert seen["forward"] and all(seen["forward"]) and seen["backward"], seen  # the block's TE Linears ran again
    assert all(seen["backward"]) is (recompute == "te"), seen
    with pytest.raises(ConfigError, match="selective.*its own"):
        checkpoint_blocks(model, [acc.unwrap_model(model).block], "selective", given)


# ------------------------------------------------------------------ LoRA


@pytest.fixture
def lora_models():
    """PEFT LoRA models, built before the TE stand-in is installed (a test names this fixture before
    ``te``): PEFT dispatches to its own TE layers when it finds TE, which the stand-in is not."""
    pytest.importorskip("peft")
    sys.path.insert(0, str(Path(__file__).parents[1] / "ao"))
    from lora_helpers import lora_llama, published_fp8_llama, with_lora

    return {"lora": lora_llama(), "published": with_lora(published_fp8_llama("ue8m0"))}


def test_lora_adapters_stay_high_precision_and_frozen_bases_run_without_a_weight_gradient(lora_models, te):
    acc = te_accelerator()
    with pytest.warns(UserWarning, match=r"15 frozen base\(s\) run in FP8 without a weight-gradient GEMM"):
        prepared = acc.prepare(lora_models["lora"])
    adapters = [m for name, m in prepared.named_modules() if ".lora_A." in name or ".lora_B." in name]
    bases = [m for name, m in prepared.named_modules() if name.endswith("base_layer")]
    assert len(adapters) == 28 and all(type(m) is nn.Linear for m in adapters)
    # the first/last rule is off by default in lowbit-te: every base is TE's, its weight still frozen
    assert len(bases) == 14 and all(isinstance(m, standin_te.Linear) and not m.weight.requires_grad for m in bases)
    assert "15 of 15 frozen layers stored and run in fp8" in acc.fp8_report()


def test_a_layer_published_in_fp8_is_refused_by_name(lora_models, te):
    with pytest.raises(UnsupportedCombinationError, match=r"lowbit-te cannot run layers published in FP8 \(14"):
        te_accelerator().prepare(lora_models["published"])
