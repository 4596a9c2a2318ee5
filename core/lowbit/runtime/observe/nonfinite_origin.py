"""Where a NaN/inf began: the step's batch replayed once, after the step was found non-finite.

Nothing of this runs on a healthy step. When the optimizer step's check finds a NaN/inf loss or
gradient, the batch the loop last took from a prepared dataloader is fed again to the model
(eager, its autocast as in training, every random stream put back after), with a hook on every
leaf module. The forward names the first module whose output is non-finite (its input finite: it
began there; its input already non-finite: between modules, in a function of the model's forward);
the backward, from the model's own loss (``outputs.loss``) or the sum of its outputs, names the
first module in backward order whose gradient went non-finite: the input-gradient computation (the
gradient it passes back is non-finite, the one it got finite) or the weight-gradient one (its
weights' gradient). For each, whether the module's weights already held a NaN/inf. Gradients are
taken with ``torch.autograd.grad``: the parameters' ``.grad`` are not touched.

Replayed only where one process can do it alone: one process, or DDP (its module, without the
wrapper's collectives). Under sharding strategies (FSDP2, DeepSpeed, tensor parallel) a replay
would gather weights on every rank: not done, and said.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.runtime.nests import tensor_leaves
from lowbit.runtime.observe.throughput import feeding_calls, random_state_kept


def _finite(value: Any) -> bool:
    tensors = [t for t in tensor_leaves(value) if t.is_floating_point() or t.is_complex()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _weights_note(module: nn.Module) -> str:
    from lowbit.runtime.finite import nonfinite

    own = [p for p in module.parameters(recurse=False)]
    if not own:
        return ""
    bad = [name for name, p in module.named_parameters(recurse=False) if nonfinite(p)]  # FP8 data widened
    return f"; its {', '.join(bad)} already held NaN/inf" if bad else "; its weights are finite"


def _gemm(module: nn.Module, phase: str) -> str:
    """Which of the module's own GEMMs ran there, when it names them (``lowbit_gemm_names``, a
    frozen FP8 base's: its forward and input-gradient GEMMs), else ''."""
    named = getattr(module, "lowbit_gemm_names", {}).get(phase)
    return f", {named}" if named else ""


def find_nonfinite_origin(model: nn.Module, batch: Any) -> str:
    """One sentence: where this batch's forward or backward first turned non-finite (or that the
    replay found everything finite: the NaN came from the data of another batch, or not at all)."""
    leaves = [(name, module) for name, module in model.named_modules() if not list(module.children())]
    order: list[tuple[str, nn.Module]] = []  # leaf modules in the order their forwards ran
    forward_origin: list[str] = []
    grad_finite: dict[int, bool] = {}  # position in ``order`` -> whether the gradient of its output is finite
    handles = []

    def after_forward(name: str):
        def hook(module, args, output):
            position = len(order)
            order.append((name, module))
            if not forward_origin and not _finite(output):
                kind = type(module).__name__
                if _finite(args):
                    forward_origin.append(
                        f"forward: {name} ({kind}{_gemm(module, 'forward')}) made its finite input non-finite"
                        f"{_weights_note(module)}"
                    )
                else:
                    forward_origin.append(
                        f"forward: the input of {name} ({kind}) was already non-finite: it began "
                        "between modules (a function in the model's forward), or in the batch"
                    )
            for tensor in tensor_leaves(output):
                if tensor.requires_grad:
                    tensor.register_hook(
                        lambda grad, position=position: grad_finite.__setitem__(
                            position, grad_finite.get(position, True) and bool(torch.isfinite(grad).all())
                        )
                    )

        return hook

    for name, module in leaves:
        handles.append(module.register_forward_hook(after_forward(name)))
    # The replay must leave the model as it found it: its forward moves BatchNorm's running stats
    # and num_batches_tracked, and draws from generators its modules hold.
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    generators = [
        (value, value.get_state())
        for module in model.modules()
        for value in vars(module).values()
        if isinstance(value, torch.Generator)
    ]
    try:
        with random_state_kept(next((p.device for p in model.parameters()), torch.device("cpu"))):
            output = _feed(model, batch)
            if forward_origin:
                return forward_origin[0]
            if not _finite(output):
                return (
                    "forward: every module's output is finite, yet the model's output is not "
                    "(it began after the last module)"
                )
            loss = getattr(output, "loss", None)
            own_loss = isinstance(loss, torch.Tensor)  # the model computes its loss (transformers' models)
            loss = loss if own_loss else sum(t.float().sum() for t in tensor_leaves(output) if t.requires_grad)
            params = [p for p in model.parameters() if p.requires_grad]
            if not isinstance(loss, torch.Tensor) or not params:
                return "the replayed forward is finite, and it has no loss to replay the backward from"
            if not bool(torch.isfinite(loss)):
                return "forward: the modules' outputs are finite; the loss computed from them is not"
            grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
        for generator, state in generators:
            generator.set_state(state)
    bad_weight_grads = {id(p) for p, g in zip(params, grads) if g is not None and not bool(torch.isfinite(g).all())}
    for position in range(len(order) - 1, -1, -1):  # backward order
        name, module = order[position]
        kind = type(module).__name__
        if not grad_finite.get(position, True):
            later = [order[i] for i in range(position + 1, len(order)) if grad_finite.get(i, True)]
            source = (
                f"in the input-gradient computation of {later[0][0]} ({type(later[0][1]).__name__}"
                f"{_gemm(later[0][1], 'input-gradient')})"
                if later
                else "in the loss's gradient, before any module"
            )
            return (
                f"backward: {source}: the gradient it passes back is non-finite, the one it got finite"
                f"{_weights_note(later[0][1]) if later else ''}"
            )
        own = [n for n, p in module.named_parameters(recurse=False) if id(p) in bad_weight_grads]
        if own:
            return (
                f"backward: the weight-gradient computation of {name} ({kind}): the gradient of its {', '.join(own)} "
                f"is non-finite, the gradient it got finite{_weights_note(module)}"
            )
    if bad_weight_grads:
        return "backward: a parameter outside the model's modules got a non-finite gradient"
    if not own_loss:
        return (
            "the model's forward and backward are finite on this batch (replayed with the sum of its outputs as the "
            "loss), so the NaN/inf arose in the loss computed outside the model (a log or division of these outputs) "
            "or in the loop itself; or a nondeterministic kernel did not repeat it"
        )
    return (
        "the replayed step (forward, the model's own loss, backward) is finite throughout: the NaN/inf did not come "
        "back with this batch (a nondeterministic kernel, or something the loop did outside the model)"
    )


def _feed(model: nn.Module, batch: Any) -> Any:
    """The model run on ``batch`` as the loop most likely fed it (``model(**batch)``, ``model(batch[0])``, ...)."""
    first_error: Exception | None = None
    for _, args, kwargs in feeding_calls(batch):
        try:
            return model(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - try the next convention
            first_error = first_error or exc
    raise first_error or ValueError("the batch holds no tensor")
