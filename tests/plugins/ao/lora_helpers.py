"""LoRA models for the FP8 LoRA tests: a tiny random-weight Llama with PEFT's LoRA on every
projection (nothing downloaded), the same with its Linears published in FP8 as transformers'
``FP8Linear`` (a fixture written here: weights quantized by the test, per 128x128 block with float32
or UE8M0 scales, or per tensor), and a counter of GEMMs by ``TorchDispatchMode``."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The shape: hidden 256, 2 layers, LoRA r=16 on every projection (all dims multiples of 16).
SHAPE = dict(
    vocab_size=128,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_mm_v2")


def base_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def with_lora(model, seed: int = 1, rank: int = 16):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # gaussian B as well as A: the adapters change the output from the first step, so a test sees them train
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights="gaussian")
    return get_peft_model(model, config)


def lora_llama(seed: int = 0):
    return with_lora(base_llama(seed))


def ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """A scale rounded up to a power of two, stored as UE8M0 (DeepSeek-V3.1's and V4's scale format)."""
    return torch.exp2(torch.ceil(torch.log2(scale))).to(torch.float8_e8m0fnu)


def quantized_for_checkpoint(weight: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as an FP8 checkpoint stores it: e4m3 data and ``weight_scale_inv``; per 128x128
    block (``float`` or ``ue8m0`` scales) or per tensor (``tensor``). Written here, not by lowbit."""
    w = weight.detach().float()
    if scale_fmt == "tensor":
        scale = w.abs().amax() / 448.0
        return (w / scale).to(torch.float8_e4m3fn), scale.reshape(())
    rows, cols = w.shape
    grid = w.reshape(rows // 128, 128, cols // 128, 128)
    scale = grid.abs().amax(dim=(1, 3)) / 448.0
    if scale_fmt == "ue8m0":
        stored = ue8m0(scale)
        scale = stored.float()
    else:
        stored = scale
    data = (grid / scale[:, None, :, None]).clamp(-448, 448).reshape(rows, cols).to(torch.float8_e4m3fn)
    return data, stored


def published_fp8_llama(scale_fmt: str, seed: int = 0):
    """A tiny Llama whose projections are transformers' FP8Linear, as an FP8 checkpoint loads them."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model = base_llama(seed)
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] not in PROJECTIONS:
            continue
        block = None if scale_fmt == "tensor" else (128, 128)
        layer = FP8Linear(
            module.in_features,
            module.out_features,
            block_size=block,
            scale_fmt="ue8m0" if scale_fmt == "ue8m0" else "float",
        )
        data, scale = quantized_for_checkpoint(module.weight, scale_fmt)
        layer.weight = torch.nn.Parameter(data, requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return model


class GemmCounter(TorchDispatchMode):
    """Counts the GEMMs that run (on real tensors; a meta tensor's GEMM computes nothing)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in GEMM_OPS and not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_gemms():
    counter = GemmCounter()
    with counter:
        yield counter


def batch(seed: int, rows: int = 8, seq: int = 32) -> torch.Tensor:
    """A learnable stream: each row counts up from a random start (mod the vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 128, (rows, 1), generator=generator)
    return (start + torch.arange(seq)) % 128
