"""The tiny seeded training that ``lowbit test`` runs (under the launcher, like a user script).

    python -m lowbit.cli.self_test WORK_DIR

Prints one line per check and a one-line verdict; exits 1 when a check fails.
"""

from __future__ import annotations

import os
import sys

# Run as a script (by `lowbit test`), this file's folder is sys.path[0]: the modules beside it
# would then shadow top-level modules of the same name for every import that follows.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import copy
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file as safetensors_load
from torch import nn

STEPS = 30


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.GELU(),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Linear(128, 64),
    )


def make_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(64, 64, generator=g)
    teacher = torch.randn(64, 64, generator=torch.Generator().manual_seed(99)) / 8
    return x, torch.tanh(x @ teacher)


class Report:
    def __init__(self, printer: Callable[[str], None]):
        self.printer = printer
        self.failed: list[str] = []
        self.passed = 0

    def check(self, name: str, ok: bool | None, detail: str) -> None:
        status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        self.printer(f"{status} {name}: {detail}")
        if ok is False:
            self.failed.append(name)
        elif ok:
            self.passed += 1

    def verdict(self) -> int:
        if self.failed:
            self.printer(f"lowbit test: FAIL ({', '.join(self.failed)})")
            return 1
        self.printer(f"lowbit test: PASS ({self.passed} checks)")
        return 0


def train_steps(acc, model, opt, x, y, steps: int, scheduler=None) -> list[float]:
    """``steps`` full-batch MSE steps on prepared objects; the loss averaged over ranks, per step."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(acc.gather(loss.detach()).mean().item())
    return losses


def _checksum(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([v.double().sum() for v in state.values()]).sum().reshape(1)


def run(work_dir: Path) -> int:
    from lowbit.compat.accelerator import Accelerator

    try:
        acc = Accelerator()
    except Exception as exc:  # noqa: BLE001 - a failed setup is the check's answer
        report = Report(print)
        report.check("backend chosen", False, f"{type(exc).__name__}: {exc}")
        return report.verdict()
    report = Report(acc.print)
    report.check(
        "hardware detected",
        True,
        f"{acc.hardware.describe()}, {acc.num_processes} process(es), strategy {acc.distributed_strategy}",
    )
    if acc.fp8_backend:
        why = acc.explain_backend_choice().splitlines()[0]
        report.check("backend chosen", True, why)
    else:
        report.check(
            "backend chosen", True, f"mixed_precision={acc.mixed_precision!r} with native autocast (no FP8 backend)"
        )

    plain = make_model()
    model = copy.deepcopy(plain)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        model, opt = acc.prepare(model, opt)
    except Exception as exc:  # noqa: BLE001
        report.check("prepare", False, f"{type(exc).__name__}: {exc}")
        return report.verdict()
    if acc.fp8_backend:
        before = {name: type(m) for name, m in plain.named_modules()}
        after = dict(acc.unwrap_model(model, keep_torch_compile=False).named_modules())
        converted = [n for n, cls in before.items() if n and n in after and type(after[n]) is not cls]
        report.check(
            "FP8 layers converted",
            bool(converted),
            f"{len(converted)} of {sum(isinstance(m, nn.Linear) for m in plain.modules())} Linear layers"
            + ("" if converted else f": the {acc.fp8_backend!r} backend converted nothing, so nothing runs in FP8"),
        )

    x, y = (t.to(acc.device) for t in make_data(acc.process_index))
    losses = train_steps(acc, model, opt, x, y, STEPS)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    report.check("loss decreasing", last < 0.8 * first, f"{first:.4f} -> {last:.4f} over {STEPS} steps")

    state = acc.get_state_dict(model)
    if acc.num_processes > 1:
        sums = acc.gather(_checksum(state).to(acc.device))
        agree = bool(torch.all(sums == sums[0]))
        report.check("ranks agreeing", agree, f"parameter checksums {['%.6f' % v for v in sums.tolist()]}")
    else:
        report.check("ranks agreeing", None, "one process")

    try:
        acc.save_state(work_dir / "state")
        train_steps(acc, model, opt, x, y, 2)
        acc.load_state(work_dir / "state")
        restored = acc.get_state_dict(model)
        same = all(torch.equal(state[k], restored[k]) for k in state)
        path = acc.save_model(model, work_dir / "model")
        make_model().load_state_dict(safetensors_load(path))
        report.check(
            "checkpoint round-trip",
            same,
            "save_state/load_state restore the weights; save_model loads into the plain model"
            if same
            else "weights after load_state differ from those saved",
        )
    except Exception as exc:  # noqa: BLE001
        report.check("checkpoint round-trip", False, f"{type(exc).__name__}: {exc}")
        acc.print(traceback.format_exc())
    return report.verdict()


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
