"""GPT-2's Conv1D layers train in FP8 under the ao backend, and save as the plain GPT-2 they were."""

from __future__ import annotations

import copy

import pytest
import torch
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

from lowbit import Accelerator

from lowbit_ao.conv1d import Float8Conv1D


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def test_float8_conv1d_computes_what_float8_linear_computes_on_the_transposed_weight():
    """Bit for bit, forward and backward: the Conv1D weight is the operand Float8Linear uses."""
    torch.manual_seed(0)
    conv = Conv1D(48, 32)  # nf=48 outputs, nx=32 inputs: weight (32, 48)
    linear = torch.nn.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    config = Float8LinearConfig(emulate=True)
    ours, reference = Float8Conv1D.from_conv1d(conv, config), Float8Linear.from_float(linear, config)
    assert ours.weight is conv.weight and ours.weight.shape == (32, 48)
    x = torch.randn(3, 5, 32)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), reference(x2)
    assert torch.equal(y1, y2)
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(ours.weight.grad, reference.weight.grad.t())
    assert torch.equal(ours.bias.grad, reference.bias.grad)


def test_gpt2_trains_in_fp8_and_saves_as_plain_gpt2(tmp_path):
    model = tiny_gpt2()
    original = copy.deepcopy(model)
    acc = Accelerator(mixed_precision="fp8")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    conv_weights = {name: m.weight for name, m in model.named_modules() if isinstance(m, Conv1D)}
    model, optimizer = acc.prepare(model, optimizer)

    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Conv1D)}
    assert len(converted) == 7  # 8 Conv1D; the first is kept in high precision
    assert "transformer.h.0.attn.c_attn" not in converted
    report = acc.fp8_report()
    assert report.startswith(
        "fp8 (ao, tensorwise, emulated): 7 of 9 Conv1D/Linear layers (Conv1D 7 of 8, Linear 0 of 1)"
    ), report
    # Same Parameter objects: the optimizer steps the weights the model uses.
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert all(
        id(dict(model.named_modules())[name].weight) in params and dict(model.named_modules())[name].weight is weight
        for name, weight in conv_weights.items()
    )

    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses

    acc.save_model(model, tmp_path)
    model.config.save_pretrained(tmp_path)
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    trained = acc.get_state_dict(model)
    assert set(reloaded.state_dict()) == set(original.state_dict())
    for name, value in reloaded.state_dict().items():
        assert value.shape == original.state_dict()[name].shape, name
        assert torch.equal(value, trained[name]), name
    assert not torch.equal(reloaded.transformer.h[1].mlp.c_fc.weight, original.transformer.h[1].mlp.c_fc.weight)


@pytest.mark.parametrize("keep_first_last", [True, False])
def test_conv1d_dims_and_first_last_rules_apply_as_for_linear(keep_first_last):
    from lowbit.utils import AORecipeKwargs

    model = torch.nn.Sequential(Conv1D(64, 32), Conv1D(40, 64), Conv1D(64, 40), Conv1D(32, 64))
    acc = Accelerator(
        mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(keep_first_last_high_precision=keep_first_last)]
    )
    model = acc.prepare(model)
    kinds = [type(m).__name__ for m in model]
    # 64 -> 40 and 40 -> 64 have a dim that is not a multiple of 16.
    assert kinds == (["Conv1D"] * 4 if keep_first_last else ["Float8Conv1D", "Conv1D", "Conv1D", "Float8Conv1D"])
    assert "dims 64x40 not divisible by 16" in acc.fp8_report()
