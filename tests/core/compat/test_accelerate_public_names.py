"""Every top-level name of Accelerate (the installed one, 1.15 here) exists in lowbit: the same
thing, or a name that refuses clearly, saying what to use. docs/coming-from-accelerate.md lists
each with its status; this test writes the list it expects when they differ."""

from __future__ import annotations

import importlib
import re

import pytest
from helpers import ROOT

import lowbit
from lowbit.big_modeling import INFERENCE_DISPATCH

from lowbit.kernel.errors import NOT_OFFERED_MARK, ConfigError, UnsupportedCombinationError

accelerate = pytest.importorskip("accelerate")
NAMES = sorted(name for name in dir(accelerate) if not name.startswith("_"))
DOC = ROOT / "docs" / "coming-from-accelerate.md"
TABLE_START = "<!-- accelerate top-level names: written by tests/core/compat/test_accelerate_public_names.py -->"


def status(name: str) -> str:
    try:
        value = getattr(lowbit, name)
    except UnsupportedCombinationError:
        return "refused on import (says what to use)"
    if getattr(value, "REFUSES_EVERY_NAME", False):
        return "module imports; each name refuses when used (says what to use)"
    if name in INFERENCE_DISPATCH:
        return "refused when called (big-model inference dispatch; says what to use)"
    return "same"


@pytest.mark.parametrize("name", NAMES)
def test_each_top_level_name_of_accelerate_is_in_lowbit_or_refused_clearly(name):
    try:
        value = getattr(lowbit, name)
    except UnsupportedCombinationError as exc:
        assert "lowbit" in str(exc) and ("use" in str(exc) or "call" in str(exc)), str(exc)
        return
    if name in INFERENCE_DISPATCH:
        with pytest.raises(UnsupportedCombinationError, match=rf"{name} places a model .* Use Accelerate's"):
            value(None)


def test_init_empty_weights_builds_a_model_in_no_memory():
    import torch

    with lowbit.init_empty_weights():
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024))
    assert all(p.is_meta for p in model.parameters()) and not model[1].running_mean.is_meta
    assert isinstance(model[0].weight, torch.nn.Parameter) and model[0].weight.requires_grad
    with lowbit.init_on_device("meta", include_buffers=True):
        assert torch.nn.BatchNorm1d(4).running_mean.is_meta
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block


def test_the_docs_list_every_name_with_its_status():
    expected = "\n".join(
        [TABLE_START, "", "| name | in lowbit |", "|---|---|", *(f"| `{name}` | {status(name)} |" for name in NAMES)]
    )
    text = DOC.read_text()
    found = re.search(re.escape(TABLE_START) + r"\n\n(?:\|.*\n)+", text)
    assert found is not None and found.group(0).rstrip("\n") == expected, f"write this into {DOC.name}:\n{expected}"


# Every name in Accelerate's API reference (the [[autodoc]] entries of docs/source/package_reference/*.md
# in Accelerate's repository, as of 1.15).
REFERENCE = [
    "accelerate.Accelerator",
    "accelerate.AutocastKwargs",
    "accelerate.DistributedDataParallelKwargs",
    "accelerate.GradScalerKwargs",
    "accelerate.InitProcessGroupKwargs",
    "accelerate.big_modeling.attach_layerwise_casting_hooks",
    "accelerate.big_modeling.cpu_offload",
    "accelerate.big_modeling.cpu_offload_with_hook",
    "accelerate.big_modeling.disk_offload",
    "accelerate.big_modeling.dispatch_model",
    "accelerate.big_modeling.init_empty_weights",
    "accelerate.big_modeling.load_checkpoint_and_dispatch",
    "accelerate.big_modeling.load_checkpoint_in_model",
    "accelerate.data_loader.BatchSamplerShard",
    "accelerate.data_loader.DataLoaderDispatcher",
    "accelerate.data_loader.DataLoaderShard",
    "accelerate.data_loader.IterableDatasetShard",
    "accelerate.data_loader.prepare_data_loader",
    "accelerate.data_loader.skip_first_batches",
    "accelerate.debug_launcher",
    "accelerate.hooks.AlignDevicesHook",
    "accelerate.hooks.LayerwiseCastingHook",
    "accelerate.hooks.ModelHook",
    "accelerate.hooks.SequentialHook",
    "accelerate.hooks.add_hook_to_module",
    "accelerate.hooks.attach_align_device_hook",
    "accelerate.hooks.attach_align_device_hook_on_blocks",
    "accelerate.hooks.attach_execution_device_hook",
    "accelerate.hooks.remove_hook_from_module",
    "accelerate.hooks.remove_hook_from_submodules",
    "accelerate.inference.prepare_pippy",
    "accelerate.logging.get_logger",
    "accelerate.notebook_launcher",
    "accelerate.optimizer.AcceleratedOptimizer",
    "accelerate.scheduler.AcceleratedScheduler",
    "accelerate.state.AcceleratorState",
    "accelerate.state.GradientState",
    "accelerate.state.PartialState",
    "accelerate.tracking.AimTracker",
    "accelerate.tracking.ClearMLTracker",
    "accelerate.tracking.CometMLTracker",
    "accelerate.tracking.GeneralTracker",
    "accelerate.tracking.MLflowTracker",
    "accelerate.tracking.SwanLabTracker",
    "accelerate.tracking.TensorBoardTracker",
    "accelerate.tracking.TrackioTracker",
    "accelerate.tracking.WandBTracker",
    "accelerate.tracking.register_tracker_class",
    "accelerate.utils.AbstractTrainStep",
    "accelerate.utils.AutocastKwargs",
    "accelerate.utils.BertTrainStep",
    "accelerate.utils.BnbQuantizationConfig",
    "accelerate.utils.ComputeEnvironment",
    "accelerate.utils.DataLoaderConfiguration",
    "accelerate.utils.DeepSpeedPlugin",
    "accelerate.utils.DistributedDataParallelKwargs",
    "accelerate.utils.DistributedType",
    "accelerate.utils.DynamoBackend",
    "accelerate.utils.FP8RecipeKwargs",
    "accelerate.utils.FullyShardedDataParallelPlugin",
    "accelerate.utils.GPTTrainStep",
    "accelerate.utils.GradScalerKwargs",
    "accelerate.utils.GradientAccumulationPlugin",
    "accelerate.utils.InitProcessGroupKwargs",
    "accelerate.utils.KwargsHandler",
    "accelerate.utils.LoggerType",
    "accelerate.utils.MegatronLMDummyDataLoader",
    "accelerate.utils.MegatronLMDummyScheduler",
    "accelerate.utils.MegatronLMPlugin",
    "accelerate.utils.PrecisionType",
    "accelerate.utils.ProfileKwargs",
    "accelerate.utils.ProjectConfiguration",
    "accelerate.utils.RNGType",
    "accelerate.utils.SageMakerDistributedType",
    "accelerate.utils.T5TrainStep",
    "accelerate.utils.TorchDynamoPlugin",
    "accelerate.utils.align_module_device",
    "accelerate.utils.apply_fp8_autowrap",
    "accelerate.utils.avg_losses_across_data_parallel_group",
    "accelerate.utils.broadcast",
    "accelerate.utils.broadcast_object_list",
    "accelerate.utils.calculate_maximum_sizes",
    "accelerate.utils.clear_environment",
    "accelerate.utils.compute_module_sizes",
    "accelerate.utils.concatenate",
    "accelerate.utils.contextual_fp8_autocast",
    "accelerate.utils.convert_model",
    "accelerate.utils.convert_outputs_to_fp32",
    "accelerate.utils.convert_to_fp32",
    "accelerate.utils.deepspeed.DeepSpeedEngineWrapper",
    "accelerate.utils.deepspeed.DeepSpeedOptimizerWrapper",
    "accelerate.utils.deepspeed.DeepSpeedSchedulerWrapper",
    "accelerate.utils.deepspeed.DummyOptim",
    "accelerate.utils.deepspeed.DummyScheduler",
    "accelerate.utils.disable_fsdp_ram_efficient_loading",
    "accelerate.utils.enable_fsdp_ram_efficient_loading",
    "accelerate.utils.environment.override_numa_affinity",
    "accelerate.utils.extract_model_from_parallel",
    "accelerate.utils.find_executable_batch_size",
    "accelerate.utils.fsdp2_load_full_state_dict",
    "accelerate.utils.fsdp2_prepare_model",
    "accelerate.utils.fsdp2_switch_optimizer_parameters",
    "accelerate.utils.gather",
    "accelerate.utils.gather_object",
    "accelerate.utils.get_active_deepspeed_plugin",
    "accelerate.utils.get_balanced_memory",
    "accelerate.utils.get_grad_scaler",
    "accelerate.utils.get_max_layer_size",
    "accelerate.utils.get_mixed_precision_context_manager",
    "accelerate.utils.get_module_children_bottom_up",
    "accelerate.utils.has_offloaded_params",
    "accelerate.utils.has_transformer_engine_layers",
    "accelerate.utils.infer_auto_device_map",
    "accelerate.utils.install_xla",
    "accelerate.utils.is_bf16_available",
    "accelerate.utils.is_mps_available",
    "accelerate.utils.is_npu_available",
    "accelerate.utils.is_torch_version",
    "accelerate.utils.is_torch_xla_available",
    "accelerate.utils.is_xpu_available",
    "accelerate.utils.listify",
    "accelerate.utils.load",
    "accelerate.utils.load_and_quantize_model",
    "accelerate.utils.load_checkpoint_in_model",
    "accelerate.utils.load_offloaded_weights",
    "accelerate.utils.load_state_dict",
    "accelerate.utils.merge_fsdp_weights",
    "accelerate.utils.offload_state_dict",
    "accelerate.utils.pad_across_processes",
    "accelerate.utils.patch_environment",
    "accelerate.utils.purge_accelerate_environment",
    "accelerate.utils.recursively_apply",
    "accelerate.utils.reduce",
    "accelerate.utils.retie_parameters",
    "accelerate.utils.save",
    "accelerate.utils.send_to_device",
    "accelerate.utils.set_module_tensor_to_device",
    "accelerate.utils.set_numa_affinity",
    "accelerate.utils.set_seed",
    "accelerate.utils.slice_tensors",
    "accelerate.utils.synchronize_rng_state",
    "accelerate.utils.synchronize_rng_states",
    "accelerate.utils.wait_for_everyone",
    "accelerate.utils.write_basic_config",
]
REFERENCE_START = "<!-- accelerate API reference: written by tests/core/compat/test_accelerate_public_names.py -->"


def lowbit_value(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module.replace("accelerate", "lowbit", 1)), name)


def reference_status(path: str) -> str:
    why = getattr(lowbit_value(path), NOT_OFFERED_MARK, None)
    return f"refused when used: it {why}" if why else "same"


@pytest.mark.parametrize("path", REFERENCE)
def test_each_name_of_accelerates_api_reference_is_in_lowbit_or_refused_clearly(path):
    value = lowbit_value(path)
    if getattr(value, NOT_OFFERED_MARK, None):
        with pytest.raises((UnsupportedCombinationError, ConfigError), match=r"(?i)\buse\b"):
            value()


def test_the_docs_list_every_name_of_the_api_reference_with_its_status():
    expected = "\n".join(
        [
            REFERENCE_START,
            "",
            "| name | in lowbit |",
            "|---|---|",
            *(f"| `{path}` | {reference_status(path)} |" for path in REFERENCE),
        ]
    )
    text = DOC.read_text()
    found = re.search(re.escape(REFERENCE_START) + r"\n\n(?:\|.*\n)+", text)
    assert found is not None and found.group(0).rstrip("\n") == expected, f"write this into {DOC.name}:\n{expected}"


def test_accelerates_utils_submodule_paths_import_under_lowbit():
    """The ``accelerate.utils.<submodule>`` imports of Accelerate's own tests, rewritten to lowbit."""
    import random

    from lowbit.utils.dataclasses import AORecipeKwargs, DataLoaderConfiguration, DistributedType  # noqa: F401
    from lowbit.utils.imports import is_deepspeed_available, is_transformers_available
    from lowbit.utils.memory import clear_device_cache, find_executable_batch_size, release_memory  # noqa: F401
    from lowbit.utils.operations import gather, recursively_apply  # noqa: F401
    from lowbit.utils.other import extract_model_from_parallel  # noqa: F401
    from lowbit.utils.random import set_seed
    from lowbit.utils.versions import compare_versions, is_torch_version

    set_seed(7)
    first = random.random()
    set_seed(7)
    assert random.random() == first  # lowbit.utils.random (the submodule) does not shadow Python's random
    assert is_torch_version(">=", "2.0") and not compare_versions("torch", "<", "2.0")
    assert isinstance(is_transformers_available(), bool) and isinstance(is_deepspeed_available(), bool)
