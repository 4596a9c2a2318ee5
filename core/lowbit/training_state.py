"""``save_state`` / ``load_state``: the Accelerator's collaborator for resumable checkpoints.

It saves what the Accelerator prepared (models, optimizers, schedulers, the fp16 scaler), the
objects registered with ``register_for_checkpointing``, every RNG, and the counters, through
the crash-safe file layer in :mod:`lowbit.checkpoint`. A distributed strategy that owns its
checkpoint format (DeepSpeed) writes the model and optimizer itself.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowbit import checkpoint
from lowbit.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from lowbit.accelerator import Accelerator


class TrainingStateCheckpointer:
    def __init__(self, accelerator: "Accelerator") -> None:
        self._acc = accelerator
        self.custom_objects: list[Any] = []

    def register(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` that save_state/load_state carry too."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ConfigError(
                    f"register_for_checkpointing got a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
                    "only such objects can be saved and restored."
                )
        self.custom_objects.extend(objects)

    def fingerprint(self) -> dict[str, Any]:
        acc = self._acc
        return {"mixed_precision": acc.mixed_precision, "fp8_backend": acc.fp8_backend, "strategy": acc.context.strategy}

    def save(self, output_dir: str | Path) -> Path:
        acc = self._acc
        output_dir = Path(output_dir)
        with checkpoint.staged_save(output_dir, acc.is_main_process, acc.wait_for_everyone) as staged:
            tmp = staged.path
            handled = False
            if acc._models and acc._strategy is not None:
                optimizer = acc._optimizers[0].optimizer if acc._optimizers else None
                handled = bool(acc._call(acc._strategy, "save_checkpoint", directory=str(tmp), model=acc._models[0], optimizer=optimizer))
            if acc.is_main_process:
                if not handled:
                    for i, model in enumerate(acc._models):
                        unwrapped = acc.unwrap_model(model)
                        checkpoint.write_file_atomically(self._encoded("model", unwrapped), tmp / f"model_{i}.pt")
                    for i, opt in enumerate(acc._optimizers):
                        checkpoint.write_file_atomically(self._encoded("optimizer", opt.optimizer), tmp / f"optimizer_{i}.pt")
                for i, model in enumerate(acc._models):
                    backend_state = acc._call(acc._fp8, "backend_checkpoint_state", model=acc.unwrap_model(model))
                    if backend_state is not None:
                        checkpoint.write_file_atomically(backend_state, tmp / f"fp8_state_{i}.pt")
                for i, sched in enumerate(acc._schedulers):
                    checkpoint.write_file_atomically(sched.state_dict(), tmp / f"scheduler_{i}.pt")
                if acc.scaler is not None:
                    checkpoint.write_file_atomically(acc.scaler.state_dict(), tmp / "scaler.pt")
                for i, obj in enumerate(self.custom_objects):
                    checkpoint.write_file_atomically(obj.state_dict(), tmp / f"custom_checkpoint_{i}.pt")
                staged.metadata.update(
                    self.fingerprint(),
                    lowbit_version=_lowbit_version(),
                    world_size=acc.num_processes,
                    step=acc.step,
                    strategy_checkpoint=handled,
                    dataloader_epochs=[d.epoch for d in acc._dataloaders],
                    custom_objects=len(self.custom_objects),
                )
            checkpoint.write_file_atomically(rng_state([d.generator for d in acc._dataloaders]),
                                             tmp / f"rng_state_{acc.process_index}.pt")
        return output_dir

    def load(self, input_dir: str | Path) -> None:
        acc = self._acc
        directory = Path(input_dir)
        if acc.is_main_process and directory.is_dir():
            checkpoint.recover(directory)
        acc.wait_for_everyone()
        meta = checkpoint.read_metadata(directory)
        checkpoint.check_same_setup(meta, self.fingerprint(), directory)
        if meta.get("custom_objects", 0) != len(self.custom_objects):
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} holds {meta.get('custom_objects', 0)} object(s) registered for "
                f"checkpointing, but this run registered {len(self.custom_objects)}. Register the same objects, in the "
                "same order, before load_state."
            )
        checkpoint.verify_files(directory, meta, required=[f"rng_state_{acc.process_index}.pt"])
        if meta.get("strategy_checkpoint"):
            optimizer = acc._optimizers[0].optimizer if acc._optimizers else None
            acc._call(acc._strategy, "load_checkpoint", directory=str(directory), model=acc._models[0], optimizer=optimizer)
        else:
            for i, model in enumerate(acc._models):
                unwrapped = acc.unwrap_model(model)
                state = self._decoded("model", unwrapped, checkpoint.read_tensor_file(directory / f"model_{i}.pt"))
                try:
                    unwrapped.load_state_dict(state)
                except RuntimeError as exc:
                    raise CheckpointError(f"{directory / f'model_{i}.pt'} does not fit this model: {exc}") from None
            for i, opt in enumerate(acc._optimizers):
                state = checkpoint.read_tensor_file(directory / f"optimizer_{i}.pt")
                opt.load_state_dict(self._decoded("optimizer", opt.optimizer, state))
        for i, model in enumerate(acc._models):
            if f"fp8_state_{i}.pt" in meta["files"]:
                path = directory / f"fp8_state_{i}.pt"
                try:
                    acc._call(acc._fp8, "load_backend_checkpoint_state", model=acc.unwrap_model(model),
                              state=checkpoint.read_tensor_file(path))
                except (ValueError, RuntimeError) as exc:
                    raise CheckpointError(f"{path} does not fit this model: {exc}") from None
        for i, sched in enumerate(acc._schedulers):
            sched.load_state_dict(checkpoint.read_tensor_file(directory / f"scheduler_{i}.pt"))
        if acc.scaler is not None:
            acc.scaler.load_state_dict(checkpoint.read_tensor_file(directory / "scaler.pt"))
        for i, obj in enumerate(self.custom_objects):
            obj.load_state_dict(checkpoint.read_tensor_file(directory / f"custom_checkpoint_{i}.pt"))
        for loader, epoch in zip(acc._dataloaders, meta.get("dataloader_epochs", [])):
            loader.set_epoch(epoch)
        acc.step = meta["step"]
        set_rng_state(checkpoint.read_tensor_file(directory / f"rng_state_{acc.process_index}.pt"),
                      [d.generator for d in acc._dataloaders])
        acc.wait_for_everyone()


    def _encoded(self, kind: str, owner: Any) -> dict[str, Any]:
        """``owner.state_dict()``, made weights_only-readable by the FP8 backend where it must be."""
        state = owner.state_dict()
        return self._acc._call(self._acc._fp8, "encode_checkpoint_state", kind=kind, owner=owner, state=state) or state

    def _decoded(self, kind: str, owner: Any, state: dict[str, Any]) -> dict[str, Any]:
        return self._acc._call(self._acc._fp8, "decode_checkpoint_state", kind=kind, owner=owner, state=state) or state


def _lowbit_version() -> str:
    from lowbit import __version__

    return __version__


def rng_state(loader_generators: list[Any] = ()) -> dict[str, Any]:
    """Every RNG a training script draws from: Python's, NumPy's (when installed), torch's, CUDA's,
    and the shuffling generators of the prepared dataloaders (so a resumed epoch draws the same order)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                             "dataloaders": [g.get_state() if g is not None else None for g in loader_generators]}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], loader_generators: list[Any] = ()) -> None:
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(state["torch"])
        for generator, saved in zip(loader_generators, state.get("dataloaders", [])):
            if generator is not None and saved is not None:
                generator.set_state(saved)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"The RNG state in this checkpoint is damaged: {type(exc).__name__}: {exc}") from None
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
