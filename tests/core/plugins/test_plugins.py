"""Plugin manager and backend selection: ranking, routing, isolation, discovery."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import BrokenOnDescribe, FakeBackend, install_plugin_module, manager_with

from lowbit import Accelerator, hookimpl

from lowbit.kernel.errors import BackendNotFoundError, BackendUnavailableError, PluginError
from lowbit.kernel.registry import PluginRegistry, choose_plugin
from lowbit.kernel.types import HardwareInfo, StrategyDescription

from lowbit.run.plugin_manager import make_plugin_manager

CPU = HardwareInfo("cpu", "CPU")


def choose(*plugins, requested=None):
    return choose_plugin(PluginRegistry(manager_with(*plugins), CPU), "backend", requested, "test")


def test_highest_priority_available_backend_wins():
    assert choose(FakeBackend("low", 100), FakeBackend("high", 300), FakeBackend("mid", 200)).name == "high"


def test_unavailable_backend_is_skipped_by_ranking():
    sel = choose(FakeBackend("high", 300, available=False, reason="needs a GPU"), FakeBackend("low", 100))
    assert sel.name == "low"
    assert "needs a GPU" in sel.explain()


def test_ties_break_by_name_whatever_the_install_order():
    a, b = FakeBackend("beta", 100), FakeBackend("alpha", 100)
    assert choose(a, b).name == "alpha"
    assert choose(FakeBackend("alpha", 100), FakeBackend("beta", 100)).name == "alpha"


def test_explicit_choice_beats_priority():
    assert choose(FakeBackend("high", 300), FakeBackend("low", 100), requested="LOW").name == "low"


def test_explicit_choice_of_unavailable_backend_is_an_error_naming_hardware():
    with pytest.raises(BackendUnavailableError, match=r"needs sm_89.*Detected hardware: CPU.*Available instead: low"):
        choose(
            FakeBackend("high", 300, available=False, reason="needs sm_89"), FakeBackend("low", 100), requested="high"
        )


def test_unknown_backend_name_suggests_nearest():
    with pytest.raises(BackendNotFoundError, match=r"Did you mean 'alpha'"):
        choose(FakeBackend("alpha", 100), requested="alpah")


def test_known_but_not_installed_backend_names_the_pip_package():
    with pytest.raises(BackendUnavailableError, match=r"pip install lowbit-te"):
        choose(FakeBackend("alpha", 100), requested="te")


def test_no_available_backend_names_what_to_install():
    with pytest.raises(BackendUnavailableError, match=r"Detected hardware: CPU.*pip install lowbit-ao"):
        choose(FakeBackend("gpu-only", 100, available=False, reason="needs CUDA"))


def test_calls_are_routed_to_the_chosen_backend_only():
    chosen, other = FakeBackend("chosen", 300), FakeBackend("other", 100)
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(chosen, other))
    import torch

    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, 16))
    assert acc.fp8_backend == "chosen"
    # autocast_context: once, at prepare (it gives the factory every forward calls)
    assert chosen.calls == ["convert_model", "wrap_optimizer", "autocast_context"]
    assert other.calls == []


def test_broken_plugin_is_reported_and_others_keep_working():
    manager = manager_with(BrokenOnDescribe(), FakeBackend("good", 100))
    sel = choose_plugin(PluginRegistry(manager, CPU), "backend")
    assert sel.name == "good"
    assert any("boom while checking availability" in b.error for b in manager.broken)


def test_strict_mode_turns_a_broken_plugin_into_an_error():
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=[BrokenOnDescribe()], strict=True)
    with pytest.raises(PluginError, match="boom"):
        PluginRegistry(manager, CPU)


def test_plugin_with_unknown_hook_name_is_reported_not_fatal():
    class Typo:
        @hookimpl
        def convert_modle(self, model):  # typo on purpose
            return model

    manager = manager_with(Typo(), FakeBackend("good", 100))
    assert any("convert_modle" in b.error for b in manager.broken)
    assert choose_plugin(PluginRegistry(manager, CPU), "backend").name == "good"


def test_duplicate_backend_names_are_refused_naming_both_distributions():
    manager = manager_with(FakeBackend("same", 100), FakeBackend("same", 200), FakeBackend("other", 50))
    registry = PluginRegistry(manager, CPU)
    assert [c.name for c in registry.ranked("backend")] == ["other"]
    assert any("claimed by both" in b.error for b in manager.broken)
    with pytest.raises(BackendUnavailableError, match=r"'same'.*claimed by both"):
        choose_plugin(registry, "backend", "same", "test")
    assert choose_plugin(registry, "backend", "other", "test").name == "other"  # an unclaimed name still works


def test_duplicate_names_across_entry_points_name_both_distributions(tmp_path, monkeypatch):
    _write_dist(tmp_path, "lowbit-first", "lowbit_first_fp8", "first", source="lowbit_thirdparty_fp8")
    _write_dist(tmp_path, "lowbit-second", "lowbit_second_fp8", "second", source="lowbit_thirdparty_fp8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOWBIT_PLUGINS", "first,second")
    registry = PluginRegistry(make_plugin_manager(), CPU)
    with pytest.raises(BackendUnavailableError, match="claimed by both lowbit-first and lowbit-second"):
        choose_plugin(registry, "backend", "thirdparty", "test")


class DescribesWithAString:
    @hookimpl
    def describe_backend(self, hardware):
        return "fp8 backend, very fast"


class WrongLaunchEnvironment:
    @hookimpl
    def launch_environment(self, args):
        return ["LOWBIT_X=1"]


class WrongHardware:
    @hookimpl(tryfirst=True)
    def detect_hardware(self, cpu):
        return "a GPU"


def test_a_wrong_result_type_marks_only_that_plugin_broken():
    manager = manager_with(DescribesWithAString(), WrongHardware(), FakeBackend("good", 100))
    acc = Accelerator(mixed_precision="no", plugin_manager=manager)
    assert acc.hardware.device_type == "cpu"  # the built-in detector answered instead
    errors = " | ".join(b.describe() for b in manager.broken)
    assert (
        "describe_backend returned 'fp8 backend, very fast': expected one of lowbit.kernel.types.BackendDescription"
        in errors
    )
    assert "detect_hardware returned 'a GPU': expected a lowbit.kernel.types.HardwareInfo" in errors
    assert choose_plugin(PluginRegistry(manager, CPU), "backend").name == "good"
    launch = manager_with(WrongLaunchEnvironment())
    assert launch.call_each("launch_environment", args=None) == []
    assert "launch_environment returned ['LOWBIT_X=1']: expected a dict" in launch.broken[0].error


def test_strict_mode_gives_a_clean_error_for_a_wrong_result_type():
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=[DescribesWithAString()], strict=True)
    with pytest.raises(PluginError, match=r"is broken: describe_backend returned 'fp8 backend, very fast'"):
        PluginRegistry(manager, CPU)


def test_lowbit_plugins_survives_a_plugin_that_describes_itself_with_a_string(tmp_path, monkeypatch):
    _write_dist(tmp_path, "lowbit-oops", "lowbit_oops_fp8", "oops")
    monkeypatch.syspath_prepend(str(tmp_path))
    from lowbit.cli.plugins_command import collect

    report = collect(cpu=True)
    broken = [row for row in report["plugins"] if row["status"] == "broken"]
    assert broken and broken[0]["distribution"] == "lowbit-oops" and "returned 'oops'" in broken[0]["reason"]


def test_a_slow_plugin_is_named_with_its_import_time(tmp_path, monkeypatch, capsys):
    _write_dist(tmp_path, "lowbit-slow", "lowbit_slow_fp8", "slow")
    monkeypatch.syspath_prepend(str(tmp_path))
    from lowbit.cli.main import main

    assert main(["plugins", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "slow plugin: 'slow' took" in out


def test_bad_description_breaks_only_that_plugin():
    class NoReason(FakeBackend):
        @hookimpl
        def describe_backend(self, hardware):
            from lowbit.kernel.types import BackendDescription

            return BackendDescription("silent", 500, available=False, reason="")

    manager = manager_with(NoReason("silent", 500), FakeBackend("good", 100))
    assert choose_plugin(PluginRegistry(manager, CPU), "backend").name == "good"
    assert any("must say why" in b.error for b in manager.broken)


def _write_dist(root, dist, module, entry_name, source=None):
    """Install tests/fixtures/plugins/<source or module>.py as module ``module`` of distribution
    ``dist``, with one entry point."""
    install_plugin_module(root, module, source)
    info = root / f"{dist.replace('-', '_')}-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[lowbit]\n{entry_name} = {module}\n")


def test_entry_point_plugin_is_discovered_and_ranked(tmp_path, monkeypatch):
    _write_dist(tmp_path, "lowbit-thirdparty", "lowbit_thirdparty_fp8", "thirdparty")
    _write_dist(tmp_path, "lowbit-broken", "lowbit_broken_fp8", "broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    manager = make_plugin_manager()
    registry = PluginRegistry(manager, CPU)
    names = [c.name for c in registry.ranked("backend")]
    assert "thirdparty" in names
    chosen = choose_plugin(registry, "backend")
    assert chosen.name == "thirdparty"  # priority 150 beats ao (100) when ao is installed
    cand = registry.find("backend", "thirdparty")
    assert (cand.description.distribution, cand.description.version) == ("lowbit-thirdparty", "0.3.0")
    assert any(b.name == "broken" and "missing dependency xyz" in b.error for b in manager.broken)


def test_lowbit_plugins_env_limits_loading(tmp_path, monkeypatch):
    _write_dist(tmp_path, "lowbit-thirdparty", "lowbit_thirdparty_fp8", "thirdparty")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOWBIT_PLUGINS", "")
    manager = make_plugin_manager()
    assert [c.name for c in PluginRegistry(manager, CPU).ranked("backend")] == []
    monkeypatch.setenv("LOWBIT_PLUGINS", "thirdparty")
    manager = make_plugin_manager()
    assert [c.name for c in PluginRegistry(manager, CPU).ranked("backend")] == ["thirdparty"]


HEAVY = ("transformer_engine", "msamp", "deepspeed", "torchao")


def _probe(*args: str) -> dict:
    """``python -m lowbit.conformance.import_probe ARGS`` in a fresh interpreter: its JSON answer."""
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit.conformance.import_probe", *args], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_discovery_imports_no_backend_library():
    assert _probe("discovery", "--heavy", *HEAVY)["imported"] == []


def test_help_does_not_import_torch():
    assert _probe("cli", "--heavy", "torch", "--", "--help")["imported"] == []


def test_installed_backends_share_option_names_only_with_the_same_meaning():
    """Env vars, YAML keys and launch flags are shared by name: two backends must agree on them."""
    registry = PluginRegistry(make_plugin_manager(), CPU)
    seen: dict[str, tuple[str, object, object]] = {}
    for cand in registry.ranked("backend"):
        if cand.description.options_class is None:
            continue
        for name, spec in cand.description.options_class.option_specs().items():
            meaning = (spec.type, spec.choices)
            if name in seen:
                other, *other_meaning = seen[name]
                assert tuple(other_meaning) == meaning, (
                    f"option {name!r} means different things in {other} and {cand.name}"
                )
            else:
                seen[name] = (cand.name, *meaning)


class WrongTrackers:
    @hookimpl
    def register_trackers(self):
        return {"mine": object}


def test_register_trackers_results_are_checked():
    manager = manager_with(WrongTrackers())
    names = [n for _, trackers in manager.call_each("register_trackers") for n in trackers]
    assert "tensorboard" in names and "mine" not in names  # the built-ins come through the same hook
    assert "register_trackers returned" in manager.broken[0].error


def test_every_plugin_reads_versions_one_way():
    """One version rule (packaging's) for every plugin's floor: 2.10 is newer than 2.9, a local
    build label or a dev build of the floor's release passes, an unreadable version is trusted."""
    from lowbit.kernel.version import older_than

    assert not older_than("2.10.0", "2.9") and older_than("2.8.1", "2.9")
    assert not older_than("0.13.0+cu126", "0.12") and not older_than("2.9.0.dev0+abc", "2.9")
    assert not older_than("custom-build", "2.9")


class NamedStrategy:
    """A third-party strategy plugin of a given name (DDP underneath)."""

    def __init__(self, name: str):
        self.name = name

    @hookimpl
    def describe_backend(self, hardware):
        return StrategyDescription(self.name, 1, True)

    @hookimpl
    def wrap_for_distribution(self, model, optimizer, context):
        return model, optimizer


def test_two_plugins_claiming_one_strategy_name_is_the_clash_not_a_missing_strategy(monkeypatch):
    """It said the name 'names no installed strategy', blaming a config file that did not exist."""
    monkeypatch.setenv("LOWBIT_DISTRIBUTED_TYPE", "mystrat")
    manager = manager_with(NamedStrategy("mystrat"), NamedStrategy("mystrat"))
    with pytest.raises(
        BackendUnavailableError,
        match=r"distributed strategy 'mystrat'.*cannot be used: distributed "
        r"strategy name 'mystrat' is claimed by both",
    ):
        Accelerator(plugin_manager=manager)


def test_a_plugin_naming_its_strategy_ddp_leaves_lowbits_ddp_working_and_is_named():
    """It set both aside, so every plain multi-process launch failed without naming the plugin."""
    impostor = NamedStrategy("ddp")
    manager = manager_with(impostor)
    registry = PluginRegistry(manager, CPU)
    chosen = registry.strategy_for("MULTI_CPU")
    assert chosen is not None and chosen.plugin is not impostor and chosen.name == "ddp"
    assert any("as lowbit's built-in one, which keeps the name" in b.error for b in manager.broken)


def test_a_namesake_entry_point_never_replaces_a_first_party_backend(tmp_path, monkeypatch):
    """A third party's entry point named "ao" (describing itself as "ao") was registered first, left
    lowbit-ao "broken" (Plugin name already registered), and fp8 trained with no FP8 layer while
    fp8_backend said "ao". lowbit-ao keeps its name; the namesake is set aside, named."""
    pytest.importorskip("lowbit_ao")
    _write_dist(tmp_path, "evil-ao", "lowbit_namesake_fp8", "ao")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOWBIT_PLUGINS", "ao")
    manager = make_plugin_manager()
    registry = PluginRegistry(manager, CPU)
    chosen = choose_plugin(registry, "backend", "ao", "test")
    assert chosen.chosen.description.distribution == "lowbit-ao"
    assert not any(b.distribution == "lowbit-ao" for b in manager.broken), manager.broken
    assert any("evil-ao" in b.error and "lowbit-ao, which keeps the name" in b.error for b in manager.broken)


@pytest.mark.parametrize(
    "dist, module",
    [("fast8-fp8", "lowbit_alias_ao_fp8"), ("fake-lowbit-ao", "lowbit_claims_ao_dist_fp8")],
    ids=["an alias ao", "a distribution it claims"],
)
def test_a_namesake_by_alias_or_by_claimed_distribution_never_replaces_lowbit_ao(tmp_path, monkeypatch, dist, module):
    """A third party answering to "ao" by an alias, or describing itself as distribution "lowbit-ao",
    was chosen when ao was asked for by name: 0 FP8 layers, rc 0. Identity comes from the
    distribution that installed the entry point; the clash is said naming both."""
    pytest.importorskip("lowbit_ao")
    _write_dist(tmp_path, dist, module, "namesake")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOWBIT_PLUGINS", "ao,namesake")
    manager = make_plugin_manager()
    registry = PluginRegistry(manager, CPU)
    chosen = choose_plugin(registry, "backend", "ao", "test")
    assert chosen.chosen.description.distribution == "lowbit-ao" and chosen.chosen.plugin.__name__ == "lowbit_ao"
    assert any(dist in b.error and "'ao', as lowbit-ao, which keeps the name" in b.error for b in manager.broken), [
        b.error for b in manager.broken
    ]
