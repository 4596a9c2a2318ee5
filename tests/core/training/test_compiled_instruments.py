"""lowbit's opt-in instruments and block formats under torch.compile: FP8 telemetry's unsampled
steps run the one compiled graph (no recompile per step), and token padding (block recipes, TE)
inside activation-checkpointed blocks adds no graph break. Both torch lanes run this."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowbit import Accelerator

pytest.importorskip("lowbit_ao")


def _fresh_counters():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return lambda: (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def test_fp8_telemetrys_unsampled_steps_run_one_compiled_graph():
    """The hooks read the recorder's step count (dynamo guarded on it: 13 graphs in 14 steps); now
    a flag set between steps: sampled and unsampled steps are two graphs at most."""
    seen = _fresh_counters()
    acc = Accelerator(cpu=True, mixed_precision="fp8")
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    acc.enable_fp8_telemetry(every_n_steps=5)

    def step(run):
        acc.backward(run(torch.randn(32, 64)).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    step(model)  # step 0: sampled, eager
    compiled = torch.compile(model, backend="aot_eager")  # guards are dynamo's: inductor's C++ would add only CI time
    for _ in range(4):  # steps 1-4: unsampled
        step(compiled)
    assert seen() == (1, 0)
    for _ in range(5):  # step 5 sampled (compiles its own graphs), then 6-9 unsampled again
        step(compiled)
    assert {row.step for row in acc.fp8_stats()} == {5}


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(64, 64), nn.Linear(64, 64)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.out(x)


def test_token_padding_inside_checkpointed_blocks_adds_no_graph_break():
    """MXFP8 pads 14 tokens to 32 around each converted layer: the pad/unpad hooks passed shapes on
    a list ("Unsafe side effect" under checkpointing); one forward that pads and unpads does not."""
    from lowbit.utils import AORecipeKwargs

    seen = _fresh_counters()
    acc = Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(recipe="mxfp8")])
    model, _ = acc.prepare(_Checkpointed(), None)
    # aot_eager: the graphs dynamo makes are the point; inductor's CPU C++ in torch 2.11 has no
    # float8_e8m0fnu (MXFP8's scale type) to generate, where a GPU's Triton has
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 7, 64)
    for _ in range(2):
        out = compiled(x)
        out.float().pow(2).mean().backward()
    assert out.shape == (2, 7, 64)
    assert seen() == (1, 0)
