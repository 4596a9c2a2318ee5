"""Accelerate's ``accelerate.utils.operations`` path: collectives and nested-structure helpers."""
from lowbit.runtime.training.operations import (  # noqa: F401 - re-exported under Accelerate's path
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    copy_tensor_to_devices,
    find_device,
    gather,
    gather_object,
    is_namedtuple,
    listify,
    pad_across_processes,
    pad_input_tensors,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)

__all__ = ["slice_tensors", "broadcast", "broadcast_object_list", "CannotPadNestedTensorWarning", "DistributedOperationException", "concatenate", "convert_outputs_to_fp32", "copy_tensor_to_devices",
           "convert_to_fp32", "find_device", "gather", "gather_object", "is_namedtuple", "listify", "pad_across_processes",
           "pad_input_tensors", "recursively_apply", "reduce", "send_to_device"]

