"""What lowbit gives transformers' Trainer and TRL, checked in one process: the patch and its undoing,
Accelerate's objects translated, the precision the launcher asks for, the Accelerate API Trainer
reads, and a census of every Accelerate name the installed transformers and TRL use."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lowbit import Accelerator  # noqa: E402
from lowbit.integrations.transformers import patch as trainer_patch  # noqa: E402

from lowbit.kernel.errors import ConfigError  # noqa: E402

# Runs another project's code (Trainer/TRL, Accelerate's own suite, transformers models): CI's third-party lane.
pytestmark = pytest.mark.third_party


@pytest.fixture
def patched():
    trainer_patch.patch_trainer()
    yield
    trainer_patch.unpatch_trainer()


# ---------------------------------------------------------------------- the patch


def test_the_patch_reaches_trainer_only_and_is_idempotent_and_reversible(patched):
    import accelerate
    import transformers.trainer
    import transformers.training_args

    from lowbit.integrations.transformers.trainer_accelerator import TrainerAccelerator

    from lowbit.compat.state import PartialState

    trainer_patch.patch_trainer()  # again: nothing more happens
    assert sys.meta_path.count(trainer_patch._FINDER) == 1
    assert transformers.trainer.Accelerator is TrainerAccelerator
    assert transformers.training_args.PartialState is PartialState
    assert transformers.trainer.DEFAULT_CALLBACKS[0].__name__ == "LowbitFiguresCallback"
    assert accelerate.Accelerator.__module__ == "accelerate.accelerator"  # what other libraries import is untouched
    from transformers.integrations import accelerate as loading  # loading and dispatch keep Accelerate's names

    assert all(
        getattr(v, "__module__", "").startswith("accelerate")
        for k, v in vars(loading).items()
        if k in ("init_empty_weights", "dispatch_model")
    )
    trainer_patch.unpatch_trainer()
    assert transformers.trainer.Accelerator is accelerate.Accelerator
    assert transformers.training_args.PartialState.__module__ == "accelerate.state"
    assert [c.__name__ for c in transformers.trainer.DEFAULT_CALLBACKS] == ["DefaultFlowCallback"]
    assert trainer_patch._FINDER not in sys.meta_path


def test_a_training_module_imported_after_the_patch_gets_lowbits_names(patched):
    pytest.importorskip("trl")
    for name in [n for n in sys.modules if n.startswith("trl.trainer.dpo")]:
        del sys.modules[name]
    dpo = importlib.import_module("trl.trainer.dpo_trainer")
    assert dpo.logger.__class__.__module__ == "lowbit.compat.logging"  # Accelerate's logger asks Accelerate's state
    assert dpo.is_peft_model.__module__ == "lowbit.compat.utils.other"


def test_launch_runs_scripts_through_the_runner_unless_told_not_to(tmp_path, monkeypatch):
    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    monkeypatch.setenv("LOWBIT_CONFIG_FILE", str(tmp_path / "none.yaml"))
    command, _, _ = build_command(build_parser().parse_args(["launch", "--cpu", str(script), "--fsdp"]))
    assert command[1:] == ["-m", "lowbit.cli.run_script", str(script), "--fsdp"]  # --fsdp is the script's
    monkeypatch.setenv("LOWBIT_PATCH_TRAINER", "0")
    command, _, _ = build_command(build_parser().parse_args(["launch", "--cpu", str(script)]))
    assert command[1:] == [str(script)]


# ---------------------------------------------------------------------- precision


@pytest.mark.parametrize(
    "trainer, asked, expected, says",
    [
        ("no", None, "no", False),
        ("no", "fp8", "fp8", False),
        ("bf16", "fp8", "fp8", True),
        ("bf16", "no", "bf16", False),
        ("fp8", "fp8", "fp8", False),
        ("bf16", None, "bf16", False),
        ("no", "bf16", "bf16", False),
    ],
)
def test_the_precision_asked_outside_the_script_reaches_the_trainer(trainer, asked, expected, says):
    from lowbit.run.settings import precision_under_front

    precision, note = precision_under_front(trainer, asked, "the launcher", "the Trainer")
    assert precision == expected and bool(note) == says


@pytest.mark.parametrize("trainer, asked", [("fp16", "bf16"), ("bf16", "fp16"), ("fp16", "fp8")])
def test_a_precision_clash_is_an_error_naming_both(trainer, asked):
    from lowbit.run.settings import precision_under_front

    with pytest.raises(ConfigError, match=f"'{trainer}'.*'{asked}'"):
        precision_under_front(trainer, asked, "the launcher", "the Trainer")


# ---------------------------------------------------------------------- Accelerate's objects


def test_accelerates_handler_objects_and_enums_become_lowbits_field_by_field():
    from accelerate.utils import (
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        TorchDynamoPlugin,
    )

    from lowbit.compat import handlers

    acc = Accelerator(
        cpu=True,
        kwargs_handlers=[
            DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook=DDPCommunicationHookType.FP16)
        ],
        dataloader_config=DataLoaderConfiguration(even_batches=False),
        dynamo_plugin=TorchDynamoPlugin(),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
    )
    ddp = acc.handlers[handlers.DistributedDataParallelKwargs]
    assert ddp.find_unused_parameters and ddp.comm_hook is handlers.DDPCommunicationHookType.FP16
    assert (
        isinstance(acc.dataloader_config, handlers.DataLoaderConfiguration) and not acc.dataloader_config.even_batches
    )
    assert acc.gradient_state.plugin_kwargs == {"num_steps": 1}  # as Accelerate keeps it; Trainer reads it


def test_a_field_lowbit_cannot_honour_is_refused_by_name_and_never_listed_as_accepted():
    from accelerate.utils import DeepSpeedPlugin

    with pytest.raises(ConfigError) as refused:
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, enable_msamp=True))
    assert "enable_msamp" in str(refused.value) and "Leave it at its default" in str(refused.value)


# ---------------------------------------------------------------------- what Trainer reads


def test_the_gradient_state_and_prepared_lists_trainer_drives():
    acc = Accelerator(cpu=True)
    model = nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.gradient_state._set_sync_gradients(False)
    assert not acc.sync_gradients
    acc.gradient_state._set_sync_gradients(True)
    assert acc._models == [model] and acc._optimizers == [opt] and acc._schedulers == [] and acc._dataloaders == []
    teacher = acc.prepare_model(nn.Linear(4, 4), device_placement=False, evaluation_mode=True)
    assert acc.prepare_model(teacher, evaluation_mode=True) is teacher and acc._models == [model, teacher]
    acc.free_memory()
    assert acc._models == [] and acc._optimizers == []
    with pytest.raises(ConfigError, match="only evaluation_mode=True"):
        acc.prepare_model(nn.Linear(4, 4), device_placement=False)


def test_one_process_reports_the_short_last_batch_and_gathers_for_metrics_as_accelerate():
    """32 samples in batches of 5 on one process: the remainder is 2, and a 0-dim leaf is
    returned whole (Trainer gathers losses; SFTTrainer gathers a 0-dim token count)."""
    acc = Accelerator(cpu=True)
    loader = acc.prepare(torch.utils.data.DataLoader(torch.arange(32.0), batch_size=5))
    for batch in loader:
        assert acc.gradient_state.remainder == 2
        gathered = acc.gather_for_metrics({"x": batch, "n": torch.tensor(3.0)})
    assert gathered["x"].tolist() == [30.0, 31.0] and gathered["n"].ndim == 0


# ---------------------------------------------------------------------- the census

# Modules of transformers and TRL whose Accelerate imports lowbit does not stand in for, and why.
CENSUS_EXCLUDED = {
    "accelerate.commands": "Accelerate's own CLI (`transformers env`, `trl env`, TRL's launcher): lowbit's CLI is "
    "`lowbit`",
}


def accelerate_usage(package: str) -> tuple[dict[tuple[str, str], str], set[str]]:
    """``from accelerate... import X`` (module, name) -> a file that does it, and the attributes
    read off an Accelerator (``accelerator.X``, ``self.accelerator.X``; ``gradient_state.X`` as
    "gradient_state.X"), in the installed package."""
    root = Path(importlib.util.find_spec(package).origin).parent
    imports, attributes = {}, set()
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(errors="ignore")
        if "accelerat" not in source:
            continue
        tree = ast.parse(source)
        # A bare `accelerator` is an Accelerate Accelerator only in a file that imports the class
        # (elsewhere it is often torch.accelerator's device).
        bare = any(
            isinstance(n, ast.ImportFrom) and n.module == "accelerate" and any(a.name == "Accelerator" for a in n.names)
            for n in ast.walk(tree)
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "accelerate":
                for alias in node.names:
                    imports.setdefault((node.module, alias.name), str(path.relative_to(root.parent)))
            elif isinstance(node, ast.Attribute) and _names_an_accelerator(node.value, bare):
                attributes.add(node.attr)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "gradient_state"
            ):
                attributes.add(f"gradient_state.{node.attr}")
    return imports, attributes


def _names_an_accelerator(node: ast.AST, bare: bool) -> bool:
    if isinstance(node, ast.Name):
        return bare and node.id == "accelerator"
    # self.accelerator / trainer.accelerator, not torch.accelerator (torch's device API)
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "accelerator"
        and not (isinstance(node.value, ast.Name) and node.value.id == "torch")
    )


def _has_path(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


@pytest.mark.parametrize("package", ["transformers", "trl"])
def test_every_accelerate_name_the_installed_package_uses_is_offered_by_lowbit(package):
    """Fails on a name a new transformers or TRL release starts using that lowbit lacks."""
    pytest.importorskip(package)
    imports, attributes = accelerate_usage(package)
    missing = []
    for (module, name), where in sorted(imports.items()):
        if any(module.startswith(prefix) for prefix in CENSUS_EXCLUDED):
            continue
        try:
            getattr(importlib.import_module("lowbit" + module[len("accelerate") :]), name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"from {module} import {name} ({where}): {exc}")
    acc = Accelerator(cpu=True)
    missing += [f"accelerator.{name}" for name in sorted(attributes) if not _has_path(acc, name)]
    assert not missing, "\n".join(missing)
    assert len(imports) > 10  # the census read the sources


def test_lowbits_figures_reach_trainers_reporting_integrations(patched, tmp_path, monkeypatch):
    """The figures callback runs before the integrations: TensorBoard's event file gets them."""
    pytest.importorskip("tensorboard")
    import argparse

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sys.path.insert(0, str(Path(__file__).parent))
    import trainer_worker

    args = argparse.Namespace(
        out=str(tmp_path), trainer="trainer", bf16=True, steps=10, resume=None, fsdp=False, deepspeed=0
    )
    run = trainer_worker.trainer(args)
    monkeypatch.setenv(
        "TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb")
    )  # where transformers' TensorBoard callback writes
    run.args.report_to, run.args.save_strategy = ["tensorboard"], "no"
    run = type(run)(model=run.model, args=run.args, train_dataset=run.train_dataset, eval_dataset=run.eval_dataset)
    run.train()
    assert type(run.accelerator).__name__ == "TrainerAccelerator"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"train/throughput/tokens_per_s", "train/throughput/mfu", "train/loss"} <= set(events.Tags()["scalars"])


def test_under_trainer_a_nan_step_is_skipped_and_said_where_it_began(patched, tmp_path):
    """transformers' Trainer filters NaN losses out of its logs and keeps stepping: on lowbit's
    Accelerator the step is skipped and the warning names where the NaN began (the replay)."""
    import warnings

    import torch
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64)
    data = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(12)]
    down = model.model.layers[1].mlp.down_proj
    poisoned = {"on": False}
    down.register_forward_hook(lambda module, args, out: out * float("inf") if poisoned["on"] else out)

    class Poison:  # a TrainerCallback by duck typing: poisons step 2's forward (and its replay)
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

        def on_step_begin(self, args, state, control, **kwargs):
            poisoned["on"] = state.global_step == 1

    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(Poison())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train()
    messages = [str(w.message) for w in said if "NaN or inf" in str(w.message)]
    assert len(messages) == 1 and "optimizer step 2" in messages[0], messages
    assert "model.layers.1.mlp.down_proj (Linear) made its finite input non-finite" in messages[0], messages
    assert all(torch.isfinite(p).all() for p in model.parameters())


def llama_and_data(seed: int = 0):

    model = tiny_llama(seed, vocab_size=64, hidden_size=32, intermediate_size=64)
    generator = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in (torch.randint(0, 64, (16,), generator=generator) for _ in range(16))
    ]
    return model, data


def test_one_trainer_trains_twice_a_second_trainer_takes_its_model_and_histories_hold_no_wall_clock(patched, tmp_path):
    """Trainer calls free_memory() then prepare() at each train(): a second train() on one Trainer,
    and a second Trainer on the same model (TRL's SFT then DPO), stopped with "prepared by another
    Accelerator". Both train now; log_history is stock's (no wall-clock figure), so two identical
    runs have equal histories."""
    from transformers import Trainer, TrainingArguments

    def args(out: str) -> TrainingArguments:
        return TrainingArguments(
            str(tmp_path / out),
            per_device_train_batch_size=4,
            max_steps=3,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_steps=1,
            bf16=True,
        )

    histories = []
    for run in ("a", "b"):
        model, data = llama_and_data()
        trainer = Trainer(model=model, args=args(run), train_dataset=data)
        trainer.train()
        histories.append(
            [{k: v for k, v in h.items() if not k.startswith("train_")} for h in trainer.state.log_history]
        )
    assert histories[0] == histories[1]
    assert not any(key.startswith("throughput/") for h in histories[0] for key in h)
    first_loss = trainer.state.log_history[0]["loss"]
    trainer.train()  # the same Trainer again
    assert type(trainer.accelerator).__name__ == "TrainerAccelerator"
    second = Trainer(model=trainer.model, args=args("c"), train_dataset=data)
    second.train()  # a second Trainer on the trained model
    assert second.state.log_history[0]["loss"] < first_loss
    # prepared three times, its forward wrapped once: the wrapper holds the class's own forward
    assert second.model.__dict__["_lowbit_original_forward"].__func__ is type(second.model).forward


def test_auto_find_batch_size_prepares_the_model_again_at_its_retry(patched, tmp_path):
    """At the first out-of-memory error Trainer frees the Accelerator and prepares the same model
    again with a smaller batch: that retry stopped with "prepared by another Accelerator"."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class OutOfMemoryAtEight(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.train_batch_size >= 8:
                raise RuntimeError("CUDA out of memory.")  # what find_executable_batch_size retries on

    model, data = llama_and_data()
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        auto_find_batch_size=True,
        bf16=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[OutOfMemoryAtEight()])
    trainer.train()
    assert trainer._train_batch_size < 8 and trainer.state.global_step == 2
    assert type(trainer.accelerator).__name__ == "TrainerAccelerator"
