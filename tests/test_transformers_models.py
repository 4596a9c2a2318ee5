"""Real Hugging Face models (tiny configs, random weights, nothing downloaded) trained the way a
user's script trains them, under every strategy, in bf16 and fp8: see models/hf_worker.py.

The runs of a strategy share one launch (2 processes over gloo, or one plain process), each run
with an Accelerator of its own; the runs are shared by the checks below. What the matrix adds to
the suite: 5 launches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import LaunchedOnce, launch_argv, run_launch
from safetensors.torch import load_file

WORKER = Path(__file__).parent / "models" / "hf_worker.py"
sys.path.insert(0, str(WORKER.parent))
from hf_worker import LR, MAX_NORM, build_model, digest  # noqa: E402

# Runs another project's code (Trainer/TRL, Accelerate's own suite, transformers models): CI's third-party lane.
pytestmark = [pytest.mark.multiprocess, pytest.mark.third_party]

STRATEGIES = {
    "single": None,  # plain `python script.py`
    "ddp": [],
    "fsdp2": ["--use_fsdp"],
    "zero2": ["--use_deepspeed", "--zero_stage", "2"],
    "zero3": ["--use_deepspeed", "--zero_stage", "3"],
}
RUNS = [("llama", strategy, precision) for strategy in STRATEGIES for precision in ("bf16", "fp8")]
RUNS += [("gpt2", "single", "fp8"), ("gpt2", "ddp", "fp8")]
# Measured: fp8 ends within 0.1% of bf16, strategies within 0.1% of one process; the bounds leave room.
FP8_LOSS_TOLERANCE = 0.02
STRATEGY_TOLERANCE = 0.01


class Runs:
    """Launch each strategy's runs once per test session, on first use of any of them."""

    def __init__(self, launched: LaunchedOnce):
        self.launched = launched

    def __call__(self, model: str, strategy: str, precision: str) -> list[dict]:
        names = [f"{m}-{p}" for m, s, p in RUNS if s == strategy]

        def launch(out: Path) -> dict[str, list[dict]]:
            env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
            env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            flags = STRATEGIES[strategy]
            worker = [str(WORKER), ",".join(names), str(out)]
            if flags is None:
                cmd = [sys.executable, *worker]
            else:
                cmd = launch_argv("--cpu", "--num_processes", "2", *flags, *worker)
            proc = run_launch(cmd, env=env)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
            results = {}
            for name in names:
                ranks = [
                    json.loads((out / name / f"result_rank{r}.json").read_text())
                    for r in range(1 if flags is None else 2)
                ]
                ranks[0]["model_dir"] = str(out / name / "model")
                results[name] = ranks
            return results

        return self.launched((strategy,), launch)[f"{model}-{precision}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(LaunchedOnce(tmp_path_factory, "transformers_models"))


@pytest.mark.parametrize("model, strategy, precision", RUNS)
def test_trains_and_ranks_agree(runs, model, strategy, precision):
    ranks = runs(model, strategy, precision)
    first = ranks[0]
    assert first["strategy"] == {"single": "none", "ddp": "ddp", "fsdp2": "fsdp"}.get(strategy, "deepspeed")
    assert first["fp8_backend"] == ("ao" if precision == "fp8" else None)
    assert first["digest"] is not None  # the main process holds the whole model
    for other in ranks[1:]:  # under FSDP2 / ZeRO-3 the others hold none of it gathered (digest None)
        assert other["losses"] == first["losses"] and other["digest"] in (first["digest"], None), "ranks disagree"
    losses = first["losses"]
    assert sum(losses[-4:]) / 4 < 0.95 * sum(losses[:4]) / 4, f"loss did not fall: {losses}"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fp8_loss_tracks_bf16(runs, strategy):
    bf16, fp8 = runs("llama", strategy, "bf16")[0], runs("llama", strategy, "fp8")[0]
    assert fp8["fp8_report"].startswith("fp8 (ao, tensorwise, emulated): 13 of 15 Linear layers"), fp8["fp8_report"]
    gap = abs(fp8["losses"][-1] - bf16["losses"][-1]) / bf16["losses"][-1]
    assert gap <= FP8_LOSS_TOLERANCE, f"fp8 final loss {fp8['losses'][-1]:.4f} vs bf16 {bf16['losses'][-1]:.4f}"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "single"])
def test_every_strategy_matches_one_process_and_clips_the_same_way(runs, strategy, precision):
    """Same global batches, so the same losses and gradient norms as one process; the first
    update of SGD is lr x max_norm, so clipping took effect (the norm returned is the real one)."""
    ours, single = runs("llama", strategy, precision)[0], runs("llama", "single", precision)[0]
    assert single["norms"][0] > MAX_NORM * 1.5, "the first gradient must be large enough to be clipped"
    assert ours["norms"][0] == pytest.approx(single["norms"][0], rel=STRATEGY_TOLERANCE)
    assert ours["updates"][0] == pytest.approx(LR * MAX_NORM, rel=STRATEGY_TOLERANCE), "the update was not clipped"
    assert ours["losses"][-1] == pytest.approx(single["losses"][-1], rel=STRATEGY_TOLERANCE)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_save_model_loads_strictly_into_a_fresh_model(runs, strategy):
    result = runs("llama", strategy, "fp8")[0]
    state = load_file(Path(result["model_dir"]) / "model.safetensors")
    fresh = build_model("llama")
    fresh.load_state_dict(state, strict=True)
    assert digest({k: v for k, v in fresh.state_dict().items()}) == result["digest"]


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_gpt2_trains_its_conv1d_layers_in_fp8(runs, strategy):
    from transformers import GPT2LMHeadModel

    result = runs("gpt2", strategy, "fp8")[0]
    assert result["fp8_report"].startswith(
        "fp8 (ao, tensorwise, emulated): 7 of 9 Conv1D/Linear layers (Conv1D 7 of 8, Linear 0 of 1)"
    )
    model_dir = Path(result["model_dir"])
    build_model("gpt2").config.save_pretrained(model_dir)
    reloaded = GPT2LMHeadModel.from_pretrained(model_dir)  # ties lm_head to wte again
    assert torch.equal(reloaded.lm_head.weight, reloaded.transformer.wte.weight)
    assert digest(reloaded.state_dict()) == result["digest"]
