"""prepare() says which Linear layers train in FP8, and why the others do not."""

from __future__ import annotations

import pytest
from torch import nn

pytest.importorskip("lowbit_ao")

from helpers import FakeBackend, manager_with, said  # noqa: E402

from lowbit import Accelerator, hookimpl  # noqa: E402

from lowbit.kernel.errors import PluginError  # noqa: E402
from lowbit.kernel.notices import LowbitWarning  # noqa: E402
from lowbit.kernel.types import ConversionReport, ConvertedModel  # noqa: E402


def test_prepare_prints_what_fp8_took(recwarn):
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 40), nn.Linear(40, 8)
    )
    acc = Accelerator(mixed_precision="fp8")
    acc.prepare(model)
    line = said(recwarn)
    assert "lowbit: note: fp8 (ao, tensorwise, emulated): 1 of 4 Linear layers" in line
    assert "0 (first Linear kept in high precision)" in line and "5 (last Linear kept in high precision)" in line
    assert "4 (dims 64x40 not divisible by 16)" in line
    assert acc.fp8_report() in line


def test_a_model_fp8_cannot_take_gets_the_reason_and_the_way_out(capsys):
    acc = Accelerator(mixed_precision="fp8")
    with pytest.warns(LowbitWarning, match=r"0 of 2 Linear layers.*Nothing trains in fp8"):
        acc.prepare(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    report = acc.fp8_report()
    assert (
        report.startswith("fp8 (ao, tensorwise, emulated): 0 of 2 Linear layers")
        and "keep_first_last_high_precision=False" in report
    )


def test_no_report_without_fp8(capsys):
    acc = Accelerator(mixed_precision="bf16")
    acc.prepare(nn.Linear(16, 16))
    assert acc.fp8_report() is None and "fp8 (" not in capsys.readouterr().out


class ReportingBackend(FakeBackend):
    """A third-party backend that returns its conversion with a typed report, or a wrong one."""

    def __init__(self, report):
        super().__init__("reporting", 500)
        self.report = report

    @hookimpl
    def convert_model(self, model, context):
        return ConvertedModel(model, self.report)


def test_a_backend_returns_its_report_typed_and_lowbit_words_it(recwarn):
    report = ConversionReport(converted=["0"], skipped={"2": "kept on purpose"}, recipe="myrecipe")
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(ReportingBackend(report)))
    model = acc.prepare(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)))
    assert acc._run.prepared.conversion_reports[acc.unwrap_model(model)] is report
    assert (
        acc.fp8_report() == "fp8 (reporting, myrecipe): 1 of 2 Linear layers; kept high precision: 2 (kept on purpose)."
    )
    assert acc.fp8_report() in said(recwarn)


def test_a_report_that_is_not_a_conversion_report_is_a_plugin_error():
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(ReportingBackend({"converted": ["0"]})))
    with pytest.raises(
        PluginError, match="convert_model returned dict, expected ConvertedModel.report: a ConversionReport"
    ):
        acc.prepare(nn.Sequential(nn.Linear(16, 16)))
