"""Built-in strategy: DistributedDataParallel over the process group torchrun set up; with a
ParallelismConfig, tensor parallelism over every process (``tp_size``, each process seeing the same
batch), or DDP over ``dp_replicate``."""

from __future__ import annotations

from lowbit.kernel.hookspecs import hookimpl
from lowbit.kernel.types import HardwareInfo, PrepareContext, StrategyDescription, StrategyMemory

from lowbit.runtime.builtin import sharded_state
from lowbit.runtime.builtin.tensor_parallel import apply_tensor_parallel, tell_transformers_the_layout

NAME = "ddp"
# Every rank holds everything; its gradient buckets are a second copy of the gradients.
MEMORY = StrategyMemory(
    buffers=("buckets",),
    note="buffers: its gradient buckets, a second copy of the gradients; "
    "measured on CPU within 15% in fp32, bf16 and fp8 (ao); other low-precision backends not measured",
)


@hookimpl
def describe_backend(hardware: HardwareInfo) -> StrategyDescription:
    # Accelerate's data-parallel names choose it; several processes with distributed_type NO too.
    return StrategyDescription(
        name=NAME,
        priority=10,
        available=True,
        aliases=("multi_gpu", "multi_cpu"),
        distributed_types=("NO", "MULTI_CPU", "MULTI_GPU"),
        reports_as="MULTI_GPU",
        kwargs_handler="DistributedDataParallelKwargs",
        launch_flag="multi_gpu",
        memory={NAME: MEMORY},
        mesh_dims=("dp_replicate", "tp"),
        # its own checkpoint (DCP, tensor-parallel runs only) reshards
        checkpoint_reshards=True,
    )


@hookimpl
def wrap_for_distribution(model, optimizer, context: PrepareContext):
    if model is None:
        return model, optimizer
    if _tensor_parallel(context):
        # All processes are tensor-parallel ranks (ParallelismConfig refuses DDP replicas of a TP
        # model): their gradients are whole already, there is nothing for DDP to average.
        model = apply_tensor_parallel(model, context)
        tell_transformers_the_layout(model, context)
        return model, optimizer
    from torch.nn.parallel import DistributedDataParallel

    options = dict(context.strategy_options)
    hook, wrapper, state_option = (
        options.pop("comm_hook", "no"),
        options.pop("comm_wrapper", "no"),
        options.pop("comm_state_option", {}),
    )
    device_ids = [context.device.index or 0] if context.device.type == "cuda" else None
    _sync_8bit_floats_as_bytes(model, DistributedDataParallel)
    model = DistributedDataParallel(model, device_ids=device_ids, **options)
    if hook != "no":
        model.register_comm_hook(*_comm_hook(hook, wrapper, state_option))
    return model, optimizer


def _sync_8bit_floats_as_bytes(model, ddp_class) -> None:
    """Tensors stored in an 8-bit float format (a frozen FP8 base's weight, a checkpoint's UE8M0
    scales) are made rank 0's here, as bytes, and DDP is told to leave them: gloo has no float8
    type (DDP's own broadcast of them fails, "Invalid scalar type"), and none of them trains, so
    DDP has nothing to bucket or to broadcast again at each forward."""
    import torch
    import torch.distributed as dist

    from lowbit.runtime.collective_device import on_group_device

    names = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not (tensor.is_floating_point() and tensor.element_size() == 1):
            continue
        raw = tensor.detach().view(torch.uint8)
        sent = on_group_device(raw)
        dist.broadcast(sent, src=0)
        raw.copy_(sent.to(raw.device))
        names.append(name)
    if names:
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(names)
        ddp_class._set_params_and_buffers_to_ignore_for_model(model, sorted(ignored))


def _tensor_parallel(context: PrepareContext) -> bool:
    return context.parallelism is not None and context.parallelism.tp_enabled


# A tensor-parallel model's weights are DTensors: gathered and checkpointed as FSDP2's are. Without
# tensor parallelism every rank holds the whole model, and lowbit writes its own files.
@hookimpl
def full_state_dict(model, context: PrepareContext):
    return sharded_state.full_state_dict(model) if _tensor_parallel(context) else None


@hookimpl
def save_checkpoint(directory: str, model, optimizer, context: PrepareContext):
    return sharded_state.save(directory, model, optimizer) if _tensor_parallel(context) else None


@hookimpl
def load_checkpoint(directory: str, model, optimizer, context: PrepareContext):
    return sharded_state.load(directory, model, optimizer) if _tensor_parallel(context) else None


def _comm_hook(hook: str, wrapper: str, state_option: dict):
    """torch's gradient-communication hook for DistributedDataParallelKwargs(comm_hook=...), with
    its state; ``comm_wrapper`` compresses what a PowerSGD hook sends to fp16 or bf16."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook in ("fp16", "bf16"):
        return None, getattr(default_hooks, f"{hook}_compress_hook")
    function = {"power_sgd": powerSGD_hook.powerSGD_hook, "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook}[
        hook
    ]
    if wrapper != "no":
        function = getattr(default_hooks, f"{wrapper}_compress_wrapper")(function)
    return powerSGD_hook.PowerSGDState(process_group=None, **state_option), function
