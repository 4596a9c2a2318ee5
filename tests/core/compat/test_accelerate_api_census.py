"""Every public method, property and attribute of the installed Accelerate's ``Accelerator``,
``PartialState``, ``AcceleratorState`` and ``GradientState`` resolves on lowbit's (the names read
off Accelerate's classes and the ``self.X =`` of their ``__init__``), so that a layer move cannot
drop one unseen; and the ones added for it (issue #62) do what Accelerate's do."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from torch import nn

from lowbit import Accelerator

from lowbit.kernel.errors import LowbitError

from lowbit.compat.state import PartialState

accelerate = pytest.importorskip("accelerate")
accelerate_state = pytest.importorskip("accelerate.state")


def public_names(cls: type) -> list[str]:
    """The class's public members, and the public attributes its ``__init__`` sets on ``self``."""
    names = {name for name in dir(cls) if not name.startswith("_")}
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and not node.attr.startswith("_"):
                names.add(node.attr)
    return sorted(names)


def lowbit_objects() -> dict[str, tuple[type, object]]:
    acc = Accelerator(cpu=True)
    return {
        "Accelerator": (accelerate.Accelerator, acc),
        "PartialState": (accelerate.PartialState, PartialState()),
        "AcceleratorState": (accelerate_state.AcceleratorState, acc.state),
        "GradientState": (accelerate_state.GradientState, acc.gradient_state),
    }


def test_every_public_name_of_accelerates_state_classes_resolves_on_lowbits():
    """A name lowbit cannot give raises an error saying so (a lowbit error, or NotImplementedError
    as Accelerate's own ``pipeline_parallel_rank``); AttributeError is a name dropped."""
    missing, counted = [], 0
    for label, (cls, ours) in lowbit_objects().items():
        for name in public_names(cls):
            counted += 1
            try:
                getattr(ours, name)
            except AttributeError:
                missing.append(f"{label}.{name}")
            except (LowbitError, NotImplementedError) as exc:
                assert "lowbit" in str(exc) or "ParallelismConfig" in str(exc), (label, name, str(exc))
    assert not missing, "Accelerate's names missing on lowbit's classes: " + ", ".join(missing)
    assert counted > 120  # the census read Accelerate's classes


def test_every_top_level_export_of_accelerate_resolves_on_lowbit():
    import lowbit

    missing = []
    for name in (n for n in dir(accelerate) if not n.startswith("_")):
        try:
            getattr(lowbit, name)
        except AttributeError:
            missing.append(name)
        except LowbitError:
            pass  # refused on import, saying what to use (test_accelerate_public_names checks the wording)
    assert not missing, missing


def test_dataloader_settings_read_and_even_batches_set_for_loaders_prepared_after():
    from lowbit.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(dispatch_batches=False, use_seedable_sampler=True, non_blocking=True)
    acc = Accelerator(cpu=True, dataloader_config=config)
    assert (acc.dispatch_batches, acc.use_seedable_sampler, acc.non_blocking, acc.even_batches) == (
        False,
        True,
        True,
        True,
    )
    assert acc.use_stateful_dataloader is False
    acc.even_batches = False
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(10)), batch_size=4))
    assert acc.even_batches is False and loader.even_batches is False


def fp16_step() -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    model = nn.Linear(8, 8)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(4, 8)).float().pow(2).mean() * 1e-3)
    return acc, model, optimizer


def test_unscale_gradients_gives_fp16_gradients_their_true_size_once_per_step():
    """The usual step before logging a grad norm under fp16: the gradients divided by the scale,
    and the step does not divide them again."""
    acc, model, optimizer = fp16_step()
    scale = acc.scaler.get_scale()
    scaled = model.weight.grad.clone()
    acc.unscale_gradients()
    assert torch.allclose(model.weight.grad * scale, scaled)
    acc.unscale_gradients(optimizer)  # again, through the prepared optimizer: no second division
    assert torch.allclose(model.weight.grad * scale, scaled)
    before = model.weight.detach().clone()
    optimizer.step()
    assert torch.allclose(model.weight, before - 0.1 * scaled / scale)


def test_clip_grad_value_clamps_the_unscaled_gradients():
    acc, model, optimizer = fp16_step()
    true_size = model.weight.grad.abs().max() / acc.scaler.get_scale()
    acc.clip_grad_value_(model.parameters(), float(true_size) / 2)
    assert torch.isclose(model.weight.grad.abs().max(), true_size / 2)
    assert acc.deepspeed_engine_wrapped is None


def test_the_rest_of_accelerates_verbs_and_attributes():
    acc = Accelerator(cpu=True)
    assert acc.is_fsdp2 is False and acc.is_composable_parallelism_enabled is False and acc.multi_device is False
    assert acc.save_iteration == 0 and acc.should_save_model is True and acc.rng_types == ["generator"]
    assert acc.fp8_enabled is False and acc.has_fp8_handler is False and acc.ddp_handler is None
    with pytest.raises(NotImplementedError, match="Pipeline parallelism"):
        acc.pipeline_parallel_rank
    with pytest.raises(ValueError, match="LOMO"):
        acc.lomo_backward(torch.tensor(1.0), 0.1)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert acc.verify_device_map(model) is False
    model.hf_device_map = {"0": 0, "1": "cpu"}
    assert acc.verify_device_map(model) is True
    calls = []
    acc.on_local_process(lambda: calls.append(1), local_process_index=0)()
    assert calls == [1]
    with acc.join_uneven_inputs([model]):  # one process: nothing to join
        pass
    state = acc.state
    assert state.is_fsdp2 is False and state.fork_launched is False and state.get_deepspeed_plugin
    with pytest.raises(KeyError, match="runs no DeepSpeed"):
        state.select_deepspeed_plugin()
    assert acc.gradient_state.initialized and acc.gradient_state.is_xla_gradients_synced is False
    PartialState().set_device()
    assert PartialState._shared_state  # transformers' use_configured_state reads it
