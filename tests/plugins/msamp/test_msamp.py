"""lowbit-msamp against a stand-in msamp (MS-AMP 0.4.0 signatures). GPU tests need real MS-AMP."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("lowbit_msamp")

import source_signatures  # noqa: E402
import torch  # noqa: E402
from helpers import (  # noqa: E402
    FakeBackend,
    HardwareDetector,
    TiedLM,
    install_entry_points,
    launch_argv,
    mlp,
    needs_fp8_gpu_with,
    regression_data,
)
from torch import nn  # noqa: E402

from lowbit import Accelerator  # noqa: E402
from lowbit.utils import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs  # noqa: E402

from lowbit.kernel.errors import BackendUnavailableError, ConfigError, UnsupportedCombinationError  # noqa: E402
from lowbit.kernel.types import HardwareInfo  # noqa: E402

from lowbit.run.plugin_manager import make_plugin_manager  # noqa: E402

import lowbit_msamp  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import standin_msamp  # noqa: E402

H100 = HardwareInfo("cpu", "stand-in NVIDIA H100 (tensors on CPU)", 1, (9, 0))
MANIFEST = json.loads((Path(__file__).parent / "msamp_signatures.json").read_text())


@pytest.fixture
def msamp(monkeypatch):
    for name, module in standin_msamp.install().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys, "meta_path", [standin_msamp.FINDER, *sys.meta_path])  # `import msamp.deepspeed`
    standin_msamp.CALLS.clear()
    yield sys.modules["msamp"]
    for name in [n for n in sys.modules if n.startswith("msamp.deepspeed")]:
        del sys.modules[name]


def manager(*extra):
    return make_plugin_manager(extra_plugins=[HardwareDetector(H100), *extra])


def accelerator(*handlers, **kwargs):
    kwargs.setdefault("mixed_precision", "fp8")
    return Accelerator(kwargs_handlers=list(handlers), plugin_manager=manager(), **kwargs)


def model_and_adamw():
    model = mlp()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def initialize_levels():
    return [c[1]["opt_level"] for c in standin_msamp.CALLS if c[0] == "initialize"]


def test_msamp_beats_te_and_ao_when_all_are_available(msamp):
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager(FakeBackend("te-like", 200)))
    assert acc.fp8_backend == "msamp"
    text = acc.explain_backend_choice()
    assert "msamp" in text and "300" in text and "te-like" in text and "ao" in text


def test_an_explicit_ao_still_wins_over_msamp(msamp):
    assert accelerator(AORecipeKwargs()).fp8_backend == "ao"
    assert accelerator(FP8RecipeKwargs(backend="ao")).fp8_backend == "ao"


def test_default_level_is_o2_and_the_swapped_objects_come_back(msamp):
    acc = accelerator()
    model, opt = model_and_adamw()
    prepared_model, prepared_opt = acc.prepare(model, opt)
    assert initialize_levels() == ["O2"]
    assert isinstance(prepared_model[2], standin_msamp.FP8Linear)
    assert isinstance(prepared_opt.optimizer, standin_msamp.LBAdamW)
    assert (
        prepared_opt.optimizer.exp_avg_dtype == torch.uint8 and prepared_opt.optimizer.exp_avg_sq_dtype == torch.float16
    )
    assert {id(p) for g in prepared_opt.param_groups for p in g["params"]} == {
        id(p) for p in prepared_model.parameters()
    }


@pytest.mark.parametrize(
    "make",
    [
        lambda: [MSAMPRecipeKwargs(opt_level="O1")],
        lambda: [MSAMPRecipeKwargs(optimization_level="O1")],
        lambda: [FP8RecipeKwargs(backend="msamp", optimization_level="O1")],
    ],
)
def test_opt_level_from_code(msamp, make):
    accelerator(*make()).prepare(*model_and_adamw())
    assert initialize_levels() == ["O1"]


def test_opt_level_from_yaml(msamp, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: fp8\nfp8_config:\n  backend: MSAMP\n  opt_level: O1\n")
    acc = Accelerator(config_file=path, plugin_manager=manager())
    assert acc.fp8_backend == "msamp"
    acc.prepare(*model_and_adamw())
    assert initialize_levels() == ["O1"]


def test_opt_level_from_launch_flags(msamp, tmp_path, monkeypatch):
    show_env = Path(__file__).parents[2] / "scripts" / "show_env.py"
    proc = subprocess.run(
        launch_argv("--mixed_precision", "fp8", "--fp8_backend=msamp", "--fp8_opt_level=O1", str(show_env)),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    backend, level, precision = env["LOWBIT_FP8_BACKEND"], env["LOWBIT_FP8_OPT_LEVEL"], env["LOWBIT_MIXED_PRECISION"]
    for key, value in (
        ("LOWBIT_FP8_BACKEND", backend),
        ("LOWBIT_FP8_OPT_LEVEL", level),
        ("LOWBIT_MIXED_PRECISION", precision),
    ):
        monkeypatch.setenv(key, value)
    acc = Accelerator(plugin_manager=manager())
    acc.prepare(*model_and_adamw())
    assert acc.fp8_backend == "msamp" and initialize_levels() == ["O1"]


@pytest.mark.parametrize(
    "bad, hint",
    [("01", "did you mean 'O1'"), ("02", "did you mean 'O2'"), ("O0", "O1 and O2"), ("O3", "Valid: O1, O2")],
)
def test_levels_are_letter_o_not_zero(bad, hint):
    with pytest.raises(ConfigError, match=hint):
        MSAMPRecipeKwargs(opt_level=bad)


def test_lower_case_level_is_accepted():
    assert MSAMPRecipeKwargs(opt_level="o2").opt_level == "O2"


def test_env_level_is_checked_too(monkeypatch):
    monkeypatch.setenv("LOWBIT_FP8_OPT_LEVEL", "01")
    with pytest.raises(ConfigError, match="starts with a zero"):
        MSAMPRecipeKwargs()


def test_model_without_optimizer_says_how_to_call_prepare(msamp):
    with pytest.raises(
        UnsupportedCombinationError, match=r"model, optimizer = accelerator.prepare\(model, optimizer\)"
    ):
        accelerator().prepare(mlp())


def test_non_adam_optimizer_is_refused_by_name(msamp):
    model = mlp()
    with pytest.raises(UnsupportedCombinationError, match=r"Adam and AdamW only.*torch.optim.sgd.SGD"):
        accelerator().prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_scheduler_and_clipping_keep_working(msamp):
    acc = accelerator()
    model, opt = model_and_adamw()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = regression_data(32)
    for _ in range(2):
        opt.zero_grad()
        acc.backward(nn.functional.mse_loss(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    assert [c[0] for c in standin_msamp.CALLS].count("clip_grad_norm_") == 2
    assert sched.get_last_lr() == [1e-3 * 0.25]
    assert sched.scheduler.optimizer is opt.optimizer  # the schedule drives MS-AMP's optimizer


def test_fsdp_with_msamp_is_a_clear_error(msamp, monkeypatch):
    monkeypatch.setenv("LOWBIT_DISTRIBUTED_TYPE", "FSDP")
    with pytest.raises(UnsupportedCombinationError, match="MS-AMP does not support PyTorch FSDP"):
        accelerator().prepare(*model_and_adamw())


@pytest.fixture
def deepspeed_with_apex_amp(monkeypatch):
    """A DeepSpeed that still has its Apex AMP integration (0.14 up to its removal): the names
    MS-AMP's engine imports exist, so lowbit's source check passes and `import msamp.deepspeed` works."""
    pytest.importorskip("lowbit_deepspeed")
    engine = importlib.import_module("deepspeed.runtime.engine")
    for name in MANIFEST["deepspeed_engine_imports"]:
        if not hasattr(engine, name):
            monkeypatch.setattr(engine, name, types.SimpleNamespace(removed_from_deepspeed=name), raising=False)
    monkeypatch.setattr(lowbit_msamp, "deepspeed_integration_problem", lambda: "")


def test_zero3_with_msamp_is_a_clear_error(msamp, monkeypatch, deepspeed_with_apex_amp):
    monkeypatch.setenv("LOWBIT_DISTRIBUTED_TYPE", "DEEPSPEED")
    monkeypatch.setenv("LOWBIT_DEEPSPEED_CONFIG", '{"zero_stage": 3}')
    with pytest.raises(UnsupportedCombinationError, match="ZeRO-3 is not supported by MS-AMP"):
        accelerator().prepare(*model_and_adamw())


@pytest.mark.parametrize("handlers, level", [([], "O2"), ([MSAMPRecipeKwargs(opt_level="O1")], "O1")])
def test_deepspeed_path_uses_msamp_deepspeed_and_its_config_section(
    msamp, monkeypatch, handlers, level, deepspeed_with_apex_amp
):
    monkeypatch.setenv("LOWBIT_DISTRIBUTED_TYPE", "DEEPSPEED")
    monkeypatch.setenv("LOWBIT_DEEPSPEED_CONFIG", '{"zero_stage": 2}')
    acc = accelerator(*handlers)
    model, opt = acc.prepare(*model_and_adamw())
    ds_calls = [c[1] for c in standin_msamp.CALLS if c[0] == "deepspeed.initialize"]
    assert ds_calls == [{"msamp": {"enabled": True, "opt_level": level}, "zero": 2}]
    # MS-AMP's DeepSpeed engine casts the raw AdamW once, through lowbit's corrected initialize:
    # on today's torch MS-AMP's own would raise TypeError (decoupled_weight_decay) or give LBAdam.
    assert initialize_levels() == [level]
    cast = model.optimizer if hasattr(model, "optimizer") else opt.optimizer
    cast = getattr(cast, "optimizer", cast)
    assert isinstance(cast, standin_msamp.LBAdamW) and cast.use_adam is False
    assert cast.exp_avg_dtype == {"O1": torch.float32, "O2": torch.uint8}[level]
    x, y = regression_data(16)
    acc.backward(nn.functional.mse_loss(model(x), y))


def test_msamp_under_a_deepspeed_without_apex_amp_is_ranked_out_before_prepare(msamp, monkeypatch):
    """MS-AMP's engine imports AMP/amp from deepspeed.runtime.engine (msamp/deepspeed/runtime/engine.py,
    v0.4.0 and main); DeepSpeed 0.19 removed them. The installed DeepSpeed is read, not guessed."""
    pytest.importorskip("lowbit_deepspeed")
    engine = importlib.import_module("deepspeed.runtime.engine")
    if hasattr(engine, "AMP"):
        pytest.skip("the installed DeepSpeed still has Apex AMP (deepspeed_with_apex_amp covers that case)")
    import deepspeed

    with pytest.raises(ImportError, match="AMP"):  # the stand-in fails where MS-AMP fails
        importlib.import_module("msamp.deepspeed")
    monkeypatch.setenv("LOWBIT_DISTRIBUTED_TYPE", "DEEPSPEED")
    monkeypatch.setenv("LOWBIT_DEEPSPEED_CONFIG", '{"zero_stage": 2}')
    acc = accelerator()
    assert acc.fp8_backend != "msamp"  # ranked out at Accelerator(), not a crash in prepare()
    why = acc.explain_backend_choice()
    assert "not under the deepspeed strategy" in why and f"deepspeed {deepspeed.__version__}" in why
    with pytest.raises(BackendUnavailableError) as err:
        accelerator(MSAMPRecipeKwargs())
    message = str(err.value)
    assert "imports AMP, amp from deepspeed.runtime.engine" in message and "deepspeed==0.13.1" in message
    assert "use backend 'te' or 'ao'" in message
    monkeypatch.setenv("LOWBIT_DISTRIBUTED_TYPE", "MULTI_GPU")  # without DeepSpeed MS-AMP still wins
    assert accelerator().fp8_backend == "msamp"


def test_the_deepspeed_check_reads_the_installed_sources(tmp_path, monkeypatch):
    """A DeepSpeed engine that binds every name MS-AMP imports passes; one that lacks them fails,
    naming them; a star import makes the answer unknowable, so nothing is ruled out."""
    from lowbit_msamp import compat

    assert list(compat.MSAMP_DEEPSPEED_ENGINE_IMPORTS) == MANIFEST["deepspeed_engine_imports"]
    engine = tmp_path / "engine.py"
    monkeypatch.setattr(compat, "_package_file", lambda package, relative: engine if package == "deepspeed" else None)
    bound = "\n".join(f"{name} = None" for name in MANIFEST["deepspeed_engine_imports"] if name != "amp")
    for source, answer in (
        (bound + "\ntry:\n    amp = object()\nexcept NameError:\n    amp = None\n", ""),
        (bound, "imports amp from"),
        ((Path(__file__).parents[2] / "fixtures" / "deepspeed_engine_with_star_import.py").read_text(), ""),
    ):
        engine.write_text(source)
        compat.deepspeed_integration_problem.cache_clear()
        problem = compat.deepspeed_integration_problem()
        assert (answer in problem) if answer else problem == "", (source[-80:], problem)
    compat.deepspeed_integration_problem.cache_clear()


@pytest.mark.parametrize(
    "make, adam_w",
    [
        (lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1), True),
        (lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True), True),
        (lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=0.1), False),
    ],
)
def test_current_pytorch_adam_and_adamw_reach_the_right_msamp_optimizer(msamp, make, adam_w):
    """MS-AMP 0.4 passes `decoupled_weight_decay` (a default of today's Adam/AdamW) on to LBAdam
    (TypeError) and takes today's AdamW, a subclass of Adam, for Adam (L2 decay). lowbit hands
    MS-AMP what it understands and keeps the decay the user chose."""
    model = mlp()
    _, prepared_opt = accelerator().prepare(model, make(model.parameters()))
    cast = prepared_opt.optimizer
    assert isinstance(cast, standin_msamp.LBAdamW) and getattr(cast, "use_adam", False) is (not adam_w)
    assert cast.defaults["weight_decay"] == 0.1 and cast.exp_avg_dtype == torch.uint8


def test_o1_with_adamw_keeps_o1s_fp32_optimizer_states(msamp):
    """MS-AMP keeps the state dtypes in LBAdamW attributes, not in defaults: rebuilt from defaults
    alone, an O1 AdamW got O2's uint8/fp16 moments."""
    model = mlp()
    _, opt = accelerator(MSAMPRecipeKwargs(opt_level="O1")).prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    cast = opt.optimizer
    assert isinstance(cast, standin_msamp.LBAdamW) and not cast.use_adam
    assert (cast.exp_avg_dtype, cast.exp_avg_sq_dtype) == (torch.float32, torch.float32)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_save_state_and_load_state_with_scaling_tensors(msamp, tmp_path, level):
    """MS-AMP's weights and O2 moments are ScalingTensor objects, which torch.load(weights_only=True) refuses."""
    acc = accelerator(MSAMPRecipeKwargs(opt_level=level))
    model, opt = acc.prepare(*model_and_adamw())
    x, y = regression_data(16)
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    raw = model.state_dict()
    assert any(isinstance(v, standin_msamp.ScalingTensor) for v in raw.values())
    with pytest.raises(Exception):  # what lowbit had written before: refused on load
        buffer = io.BytesIO()
        torch.save(raw, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    acc.save_state(tmp_path / "ckpt")
    fresh_acc = accelerator(MSAMPRecipeKwargs(opt_level=level))
    fresh, fresh_opt = fresh_acc.prepare(*model_and_adamw())
    fresh_acc.load_state(tmp_path / "ckpt")
    for key, value in model.state_dict().items():
        mine = fresh.state_dict()[key]
        assert torch.equal(getattr(mine, "value", mine), getattr(value, "value", value)), key
    saved_moments = opt.optimizer.state_dict()["state"][0]["exp_avg"]
    loaded_moments = fresh_opt.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(getattr(saved_moments, "value", saved_moments), getattr(loaded_moments, "value", loaded_moments))


def test_save_state_keeps_msamps_scaling_windows_and_amax_counters(msamp, tmp_path):
    """Each FP8Linear's scaling_metas (amax windows of 16 steps, amax_counter) live outside every state
    dict; without them a resumed run restarts in-time scaling's warm-up (is_warmup: counter < window)."""
    acc = accelerator()
    model, opt = acc.prepare(*model_and_adamw())
    x, y = regression_data(16)
    for _ in range(3):
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    trained = {name: m.scaling_metas for name, m in model.named_modules() if isinstance(m, standin_msamp.FP8Linear)}
    assert trained and all(int(metas["input"].amax_counter) == 3 for metas in trained.values())
    acc.save_state(tmp_path / "ckpt")
    fresh_acc = accelerator()
    fresh, _ = fresh_acc.prepare(*model_and_adamw())
    flat = [m.scaling_metas["input"].amax_counter for m in fresh.modules() if isinstance(m, standin_msamp.FP8Linear)]
    fresh_acc.load_state(tmp_path / "ckpt")
    for name, module in fresh.named_modules():
        if isinstance(module, standin_msamp.FP8Linear):
            for kind, meta in module.scaling_metas.items():
                for t in ("scale", "amax", "amax_counter"):
                    assert torch.equal(getattr(meta, t), getattr(trained[name][kind], t)), (name, kind, t)
            assert bool(module.scaling_metas["input"].is_warmup())  # 3 of 16 steps: still in the warm-up
    # copied in place: MS-AMP's flattened buffers (model_state) keep pointing at the same tensors
    assert [m.scaling_metas["input"].amax_counter for m in fresh.modules() if isinstance(m, standin_msamp.FP8Linear)][
        0
    ] is flat[0]


def test_a_linear_tied_to_an_embedding_stays_tied_and_high_precision(msamp):
    model = TiedLM()
    prepared, _ = accelerator().prepare(model, torch.optim.AdamW(model.parameters()))
    assert type(prepared.head) is nn.Linear and prepared.head.weight is prepared.embed.weight
    assert isinstance(prepared.mid, standin_msamp.FP8Linear)


def test_msamp_without_its_te_extension_is_unavailable_and_loses_the_ranking(msamp, monkeypatch):
    monkeypatch.delitem(sys.modules, "transformer_engine_extensions")
    assert "transformer_engine_extensions" in lowbit_msamp.unavailable_reason(H100)
    assert Accelerator(mixed_precision="fp8", plugin_manager=manager()).fp8_backend == "ao"


def test_availability_reasons():
    """What the machine lacks comes first (installing MS-AMP would not help on a CPU), then the install."""
    reason = lowbit_msamp.unavailable_reason(HardwareInfo("cpu", "CPU"))
    assert reason.startswith(
        "MS-AMP needs CUDA (a GPU with compute capability >= 8.9); found CPU (and msamp is not installed"
    )
    assert lowbit_msamp.unavailable_reason(HardwareInfo("cuda", "NVIDIA H100", 1, (9, 0))).startswith(
        "msamp not importable"
    )


def test_availability_reasons_with_msamp(msamp):
    assert (
        lowbit_msamp.unavailable_reason(HardwareInfo("cpu", "CPU"))
        == "MS-AMP needs CUDA (a GPU with compute capability >= 8.9); found CPU"
    )
    assert "found NVIDIA A100 (sm_80)" in lowbit_msamp.unavailable_reason(
        HardwareInfo("cuda", "NVIDIA A100", 1, (8, 0))
    )
    with pytest.raises(
        BackendUnavailableError, match=r"MS-AMP needs CUDA \(a GPU with compute capability >= 8.9\); found CPU"
    ):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[MSAMPRecipeKwargs()])


def test_export_dequantizes_scaling_tensors():
    class ScalingTensorLike:
        meta = object()

        def float(self):
            return torch.ones(2)

    out = lowbit_msamp.export_state_dict(None, {"w": ScalingTensorLike(), "b": torch.zeros(2)}, None)
    assert torch.equal(out["w"], torch.ones(2)) and torch.equal(out["b"], torch.zeros(2))


@needs_fp8_gpu_with("msamp", "MS-AMP")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gpu_real_msamp_trains_close_to_bf16(level):
    import msamp

    from lowbit.cli.self_test import train_steps

    losses = {}
    for precision in ("bf16", "fp8"):
        torch.manual_seed(0)
        handlers = [MSAMPRecipeKwargs(opt_level=level)] if precision == "fp8" else []
        acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers)
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        if precision == "fp8":
            assert acc.fp8_backend == "msamp"
            assert any(type(m).__module__.startswith("msamp") for m in model.modules())
            assert type(opt.optimizer).__module__.startswith("msamp"), type(opt.optimizer)
        x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
        losses[precision] = train_steps(acc, model, opt, x, y, 20)
    assert losses["fp8"][-1] < 0.7 * losses["fp8"][0]
    assert abs(losses["fp8"][-1] - losses["bf16"][-1]) / losses["bf16"][-1] < 0.05
    assert msamp.__version__


@needs_fp8_gpu_with("msamp", "MS-AMP")
def test_gpu_the_conformance_kit_passes_on_real_msamp(tmp_path):
    from lowbit.conformance import run_conformance

    assert run_conformance("msamp", heavy_modules=("msamp",), tmp_path=tmp_path)["converted"]


def test_the_conformance_kit_passes_on_the_msamp_stand_in(msamp, tmp_path):
    """Through the installed entry point, on a stand-in H100 (tensors stay on the CPU)."""
    from lowbit.conformance import run_conformance

    report = run_conformance("msamp", heavy_modules=("msamp",), hardware=H100, tmp_path=tmp_path)
    assert report["converted"]


# ------------------------------------------------------------------ the stand-in cannot drift


STANDIN_OBJECTS = {
    "msamp.initialize": standin_msamp.initialize,
    "msamp.clip_grad_norm_": standin_msamp.clip_grad_norm_,
    "msamp.optim.LBAdamW": standin_msamp.LBAdamW,
    "msamp.optim.LBAdam": standin_msamp.LBAdam,
    "msamp.deepspeed.initialize": standin_msamp.deepspeed_initialize,
    "msamp.common.tensor.ScalingTensor": standin_msamp.ScalingTensor,
    "msamp.common.tensor.ScalingMeta": standin_msamp.ScalingMeta,
}


@pytest.mark.parametrize("name", sorted(MANIFEST["signatures"]))
def test_standin_signatures_match_the_msamp_manifest(name):
    """The manifest was read from MS-AMP's source at the commits it records
    (tests/plugins/msamp/read_msamp_signatures.py); the stand-in must have exactly those parameters."""
    standin = source_signatures.as_text(source_signatures.parameters_of(STANDIN_OBJECTS[name]))
    revisions = ", ".join(f"{rev} {r['commit'][:12]}" for rev, r in MANIFEST["revisions"].items())
    assert standin == MANIFEST["signatures"][name], f"stand-in {name} differs from MS-AMP ({revisions})"


def _manifest_signature(name):
    args = ast.parse(f"def f({MANIFEST['signatures'][name]}): pass").body[0].args
    return source_signatures.signature(args)


def _calls_into_msamp():
    """Every call lowbit makes into MS-AMP, read from the plugins' source: ``msamp.NAME(...)`` and
    ``msamp.optim.NAME(...)`` in lowbit-msamp, and lowbit-deepspeed's ``initialize_fn(...)`` (which
    is ``msamp.deepspeed.initialize`` when MS-AMP supplies it), as (name, positional, keywords, where)."""
    sources = [(Path(importlib.util.find_spec("lowbit_msamp").origin).parent, None)]
    if importlib.util.find_spec("lowbit_deepspeed") is not None:
        sources.append((Path(importlib.util.find_spec("lowbit_deepspeed").origin).parent, "initialize_fn"))
    calls = []
    for folder, alias in sources:
        for file in sorted(folder.glob("*.py")):
            for node in ast.walk(ast.parse(file.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                dotted = ast.unparse(node.func)
                name = "msamp.deepspeed.initialize" if alias and dotted == alias else dotted
                if name in MANIFEST["signatures"] or (name.startswith("msamp.") and not alias):
                    positional = sum(1 for a in node.args if not isinstance(a, ast.Starred))
                    keywords = tuple(k.arg for k in node.keywords if k.arg)
                    calls.append((name, positional, keywords, f"{file.name}:{node.lineno}"))
    return calls


def test_every_msamp_call_of_lowbit_binds_to_msamp_signatures():
    calls = _calls_into_msamp()
    assert {c[0] for c in calls} >= {"msamp.initialize", "msamp.clip_grad_norm_", "msamp.optim.LBAdamW"}
    for name, positional, keywords, where in calls:
        assert name in MANIFEST["signatures"], f"{where}: lowbit calls {name}, which the manifest does not record"
        try:
            _manifest_signature(name).bind(*range(positional), **dict.fromkeys(keywords))
        except TypeError as exc:
            pytest.fail(
                f"{where}: {name}({positional} positional, {', '.join(keywords)}) does not fit MS-AMP's "
                f"({MANIFEST['signatures'][name]}): {exc}"
            )


def test_a_call_msamp_would_refuse_does_not_bind():
    with pytest.raises(TypeError, match="weight_qtype"):
        _manifest_signature("msamp.initialize").bind(1, 2, opt_level="O2", weight_qtype=None)


# ------------------------------------------------------------------ its pins, from metadata


def install_msamp_distribution(site, requires):
    """MS-AMP's metadata as its pip install leaves it: the distribution is named "MS-AMP"
    (its pyproject.toml, 0.4.0 and main) and provides the package ``msamp`` (top_level.txt)."""
    info = install_entry_points(site, "MS-AMP", "0.4.0", {}, requires=requires)
    (info / "top_level.txt").write_text("msamp\n")
    return info


def test_msamp_whose_pins_are_not_met_is_unavailable_says_what_to_change_and_loses_the_ranking(
    msamp, tmp_path, monkeypatch
):
    """MS-AMP 0.4.0's own requirements (from the manifest) against what is installed here:
    deepspeed 0.19 against its ==0.13.1 pin, and no Transformer Engine at all."""
    install_msamp_distribution(tmp_path, requires=tuple(MANIFEST["dependencies"]))
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = lowbit_msamp.unavailable_reason(H100)
    assert reason.startswith("MS-AMP cannot run with what is installed here: ")
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed

        assert (
            f"MS-AMP 0.4.0 requires deepspeed==0.13.1, installed {deepspeed.__version__}: "
            '`pip install "deepspeed==0.13.1"` (lowbit-deepspeed needs deepspeed>=0.14'
        ) in reason
    assert (
        "transformer-engine is not installed (MS-AMP 0.4.0 requires transformer-engine from "
        "git+https://github.com/NVIDIA/TransformerEngine.git@v1.1)"
    ) in reason
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager())
    assert acc.fp8_backend == "ao" and "deepspeed==0.13.1" in acc.explain_backend_choice()


def test_msamp_whose_requirements_are_met_stays_first(msamp, tmp_path, monkeypatch):
    install_msamp_distribution(tmp_path, requires=("torch>=2", "packaging", 'pytest-cov; extra == "test"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert lowbit_msamp.unavailable_reason(H100) == ""
    assert Accelerator(mixed_precision="fp8", plugin_manager=manager()).fp8_backend == "msamp"


def test_a_transformer_engine_of_another_major_than_the_git_tag_is_named(monkeypatch, tmp_path):
    from lowbit_msamp import compat

    install_msamp_distribution(tmp_path, requires=(MANIFEST["dependencies"][1],))
    install_entry_points(tmp_path, "transformer-engine", "2.20.2", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert compat.unmet_requirements() == [
        "MS-AMP 0.4.0 requires transformer-engine 1.1 (from git+https://github.com/NVIDIA/TransformerEngine.git@v1.1), "
        'installed 2.20.2: `pip install "transformer-engine @ git+https://github.com/NVIDIA/TransformerEngine.git@v1.1"`'
    ]


def test_lora_adapters_and_frozen_bases_stay_high_precision_and_the_note_says_why(msamp):
    pytest.importorskip("peft")
    sys.path.insert(0, str(Path(__file__).parents[1] / "ao"))
    from lora_helpers import lora_llama

    model = lora_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.warns(UserWarning, match=r"keeps 15 frozen base\(s\) in high precision: MS-AMP computes a weight"):
        prepared, _ = accelerator().prepare(model, optimizer)
    layers = {
        name: type(m)
        for name, m in prepared.named_modules()
        if ".lora_A." in name or ".lora_B." in name or name.endswith("base_layer")
    }
    assert len(layers) == 42 and all(cls is torch.nn.Linear for cls in layers.values())


def test_a_layer_published_in_fp8_is_refused_by_name(msamp):
    pytest.importorskip("peft")
    sys.path.insert(0, str(Path(__file__).parents[1] / "ao"))
    from lora_helpers import published_fp8_llama, with_lora

    model = with_lora(published_fp8_llama("float"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(UnsupportedCombinationError, match=r"cannot run layers published in FP8 \(14, the first"):
        accelerator().prepare(model, optimizer)
