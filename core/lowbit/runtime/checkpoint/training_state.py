"""``save_state`` / ``load_state``: the run's part for resumable checkpoints.

It saves what was prepared (models, optimizers, schedulers, the fp16 scaler), the objects
registered with ``register_for_checkpointing``, every RNG, and the counters, through the
crash-safe file layer in :mod:`lowbit.runtime.checkpoint.files`. A distributed strategy that owns its
checkpoint format (DeepSpeed, FSDP2's DCP) writes the model and optimizer itself; the backend
turns its state into plain tensors (``encode_checkpoint_state``) and saves what lives outside the
state dict (``backend_checkpoint_state``).
"""

from __future__ import annotations

import functools
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from lowbit.kernel import version as lowbit_version
from lowbit.kernel.errors import CheckpointError, ConfigError
from lowbit.kernel.notices import note

from lowbit.runtime.checkpoint import files as checkpoint
from lowbit.runtime.checkpoint import plain_state
from lowbit.runtime.checkpoint.accelerate_checkpoint import is_accelerate_checkpoint, load_accelerate_checkpoint
from lowbit.runtime.checkpoint.cuda_rng import cuda_rng_state, set_cuda_rng_states
from lowbit.runtime.checkpoint.finite_weights import refuse_nonfinite_weights
from lowbit.runtime.process_group import ProcessFacts, every_rank_must_arrive, wait_for_everyone
from lowbit.runtime.routing import ChosenPlugins
from lowbit.runtime.training.preparation import unwrap
from lowbit.runtime.training.prepared import PreparedObjects, StepState, TrainingCounters


class TrainingStateCheckpointer:
    """Saves and restores a run. Given the chosen plugins (strategy- and backend-owned state), the
    prepared objects, the step state (the run's precision: the fp16 scaler), the process facts and the counters."""

    def __init__(
        self,
        plugins: ChosenPlugins,
        prepared: PreparedObjects,
        step_state: StepState,
        facts: ProcessFacts,
        counters: TrainingCounters,
    ) -> None:
        self.plugins, self.prepared, self.step_state, self.facts, self.counters = (
            plugins,
            prepared,
            step_state,
            facts,
            counters,
        )
        self.custom_objects: list[Any] = []
        # Accelerate's save/load pre-hooks, by handle id (register_save_state_pre_hook, ...); an
        # OrderedDict, which torch's RemovableHandle can hold a weak reference to.
        self.save_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self.load_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    def register(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` that save_state/load_state carry too."""
        bad = [
            f"- Item at index {i} is a {type(obj).__name__}"
            for i, obj in enumerate(objects)
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))
        ]
        if bad:
            raise ConfigError(
                "register_for_checkpointing can save and restore only objects with state_dict() and "
                "load_state_dict(); nothing was registered. These have neither:\n" + "\n".join(bad)
            )
        self.custom_objects.extend(objects)

    def fingerprint(self) -> dict[str, Any]:
        context = self.plugins.context
        return {
            "mixed_precision": context.mixed_precision,
            "fp8_backend": self.plugins.backend_name,
            "strategy": context.strategy,
        }

    def _strategy_objects(self) -> tuple[Any, Any]:
        """The model and (inner) optimizer a strategy saves and loads itself."""
        prepared = self.prepared
        return prepared.models[0], (prepared.optimizers[0].optimizer if prepared.optimizers else None)

    def refuse_nonfinite_weights(self) -> None:
        """Before a save (and before an automatic name prunes old checkpoints): no NaN/inf weight."""
        refuse_nonfinite_weights(
            [unwrap(model) for model in self.prepared.models], "save_state", self.facts.num_processes
        )

    def save(self, output_dir: str | Path) -> Path:
        prepared, plugins, is_main = self.prepared, self.plugins, self.facts.is_main_process
        output_dir = Path(output_dir)
        # Every rank, before anything is written: a state the reader could not read back stops the save
        # everywhere alike.
        custom_states = [
            plain_state.encode(obj.state_dict(), f"registered object {i} ({type(obj).__name__})")
            for i, obj in enumerate(self.custom_objects)
        ]
        with checkpoint.staged_save(output_dir, is_main, lambda: every_rank_must_arrive("save_state")) as staged:
            tmp = staged.path
            handled = False
            if prepared.models and plugins.strategy is not None:
                handled = plugins.save_checkpoint(str(tmp), *self._strategy_objects())
            # The pre-hooks see the models and their weights, and may take weights out of the list
            # to save those models their own way (diffusers' save_pretrained into output_dir).
            models = [unwrap(model) for model in prepared.models]
            weights = [] if handled else [model.state_dict() for model in models]
            for hook in self.save_pre_hooks.values():
                hook(models, weights, str(output_dir))
            if is_main:
                if not handled:
                    for i, (plain, state) in enumerate(zip(models, weights)):
                        checkpoint.write_file_atomically(
                            plugins.encode_checkpoint_state("model", plain, state), tmp / f"model_{i}.pt"
                        )
                    for i, opt in enumerate(prepared.optimizers):
                        inner = opt.optimizer
                        checkpoint.write_file_atomically(
                            plugins.encode_checkpoint_state("optimizer", inner, inner.state_dict()),
                            tmp / f"optimizer_{i}.pt",
                        )
                for i, model in enumerate(prepared.models):
                    backend_state = plugins.backend_checkpoint_state(unwrap(model))
                    if backend_state is not None:
                        checkpoint.write_file_atomically(backend_state, tmp / f"fp8_state_{i}.pt")
                for i, sched in enumerate(prepared.schedulers):
                    checkpoint.write_file_atomically(sched.state_dict(), tmp / f"scheduler_{i}.pt")
                precision_state = self.step_state.precision.state_dict()
                if precision_state is not None:
                    checkpoint.write_file_atomically(precision_state, tmp / "scaler.pt")
                for i, state in enumerate(custom_states):
                    checkpoint.write_file_atomically(state, tmp / f"custom_checkpoint_{i}.pt")
                staged.metadata.update(
                    self.fingerprint(),
                    # what the backend trained with (informational: a backend whose state depends on it says so at load)
                    recipe=getattr(plugins.context.backend_options, "recipe", None),
                    lowbit_version=lowbit_version.__version__,
                    world_size=self.facts.num_processes,
                    step=self.counters.step,
                    strategy_checkpoint=handled,
                    dataloader_epochs=[d.epoch_to_resume() for d in prepared.dataloaders],
                    custom_objects=len(self.custom_objects),
                )
            checkpoint.write_file_atomically(
                rng_state(
                    [d.generator for d in prepared.dataloaders], [d.epoch_order_state() for d in prepared.dataloaders]
                ),
                tmp / f"rng_state_{self.facts.process_index}.pt",
            )
        return output_dir

    def load(self, input_dir: str | Path, allow_precision_change: bool = False) -> None:
        prepared, plugins = self.prepared, self.plugins
        directory = Path(input_dir)
        if self.facts.is_main_process and directory.is_dir():
            checkpoint.recover_for_reading(directory)
        every_rank_must_arrive("load_state")
        if not (directory / checkpoint.METADATA_FILE).exists() and is_accelerate_checkpoint(directory):
            load_accelerate_checkpoint(self, directory, unwrap)  # a run moving over from Accelerate
            self._weights_replaced()
            return
        meta = checkpoint.read_metadata(directory)
        expected = self.fingerprint()
        backend_changed = meta.get("fp8_backend") != expected["fp8_backend"]
        if allow_precision_change:
            changed = [
                f"{key} {meta.get(key)!r} -> {expected.pop(key)!r}"
                for key in PRECISION_KEYS
                if meta.get(key) != expected[key]
            ]
            if changed:
                note(
                    f"load_state: resuming {str(directory)!r} with another precision ({', '.join(changed)}): weights, "
                    "optimizer, scheduler and counters load"
                    + ("; the old backend's own state (its scales) is left out." if backend_changed else ".")
                )
        checkpoint.check_same_setup(meta, expected, directory)
        if meta.get("custom_objects", 0) != len(self.custom_objects):
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} holds {meta.get('custom_objects', 0)} object(s) registered for "
                f"checkpointing, but this run registered {len(self.custom_objects)}. Register the same objects, in the "
                "same order, before load_state."
            )
        rng_file = self._rng_file(meta, directory)
        checkpoint.verify_files(directory, meta, required=[rng_file])
        # Every file is read and checked against its target before anything is loaded, so a file
        # that does not fit leaves the run as it was.
        loads: list[Callable[[], Any]] = []
        # The pre-hooks may take models out of the list to load those their own way.
        models = [unwrap(model) for model in prepared.models]
        for hook in self.load_pre_hooks.values():
            hook(models, str(directory))
        if meta.get("strategy_checkpoint"):
            loads.append(functools.partial(plugins.load_checkpoint, str(directory), *self._strategy_objects()))
        else:
            for i, plain in enumerate(models):
                path = directory / f"model_{i}.pt"
                state = plugins.decode_checkpoint_state("model", plain, checkpoint.read_tensor_file(path))
                checkpoint.check_state_fits(plain, state, path)
                loads.append(functools.partial(plain.load_state_dict, state))
            for i, opt in enumerate(prepared.optimizers):
                path = directory / f"optimizer_{i}.pt"
                state = plugins.decode_checkpoint_state("optimizer", opt.optimizer, checkpoint.read_tensor_file(path))
                checkpoint.check_optimizer_state_fits(opt.optimizer, state, path)
                loads.append(functools.partial(opt.load_state_dict, state))
        for i, model in enumerate(prepared.models):
            if f"fp8_state_{i}.pt" in meta["files"] and not backend_changed:
                path = directory / f"fp8_state_{i}.pt"
                loads.append(
                    functools.partial(self._load_backend_state, unwrap(model), checkpoint.read_tensor_file(path), path)
                )
        for i, sched in enumerate(prepared.schedulers):
            loads.append(
                functools.partial(sched.load_state_dict, checkpoint.read_tensor_file(directory / f"scheduler_{i}.pt"))
            )
        if self.step_state.precision.scaler is not None and "scaler.pt" in meta["files"]:
            loads.append(
                functools.partial(
                    self.step_state.precision.load_state_dict, checkpoint.read_tensor_file(directory / "scaler.pt")
                )
            )
        for i, obj in enumerate(self.custom_objects):
            loads.append(
                functools.partial(
                    obj.load_state_dict,
                    plain_state.decode(
                        checkpoint.read_tensor_file(directory / f"custom_checkpoint_{i}.pt"),
                        str(directory / f"custom_checkpoint_{i}.pt"),
                    ),
                )
            )
        rng = checkpoint.read_tensor_file(directory / rng_file)
        for load in loads:
            load()
        for loader, epoch in zip(prepared.dataloaders, meta.get("dataloader_epochs", [])):
            loader.set_epoch(epoch)
        self.counters.step = meta["step"]
        set_rng_state(rng, [d.generator for d in prepared.dataloaders])
        for loader, order in zip(prepared.dataloaders, rng.get("epoch_orders", [])):
            loader.replay_epoch_order(order)  # saved mid-epoch: the resumed epoch keeps its order
        self._weights_replaced()

    def _rng_file(self, meta: dict[str, Any], directory: Path) -> str:
        """This rank's RNG file. On another number of processes than the save's (resharding): rank
        r takes saved rank r mod N's, where the strategy's checkpoint reshards (DCP) or lowbit wrote
        whole files; the data is split anew, so the run goes on but is not the saved run's twin."""
        saved, now, rank = meta["world_size"], self.facts.num_processes, self.facts.process_index
        if saved == now:
            return f"rng_state_{rank}.pt"
        strategy = self.plugins.strategy
        if meta.get("strategy_checkpoint") and not (
            strategy is not None and strategy.chosen.description.checkpoint_reshards
        ):
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} was saved by {saved} process(es) and this run has {now}, but the "
                f"{meta.get('strategy')!r} strategy's checkpoints do not reshard. Resume with {saved} processes "
                f"(`lowbit launch --num_processes {saved}`)."
            )
        if self.facts.is_main_process:
            note(
                f"load_state: {str(directory)!r} was saved by {saved} process(es), this run has {now}: weights, "
                "optimizer "
                f"and counters are resharded; each process takes saved rank (rank mod {saved})'s random state, and the "
                "data is split anew, so the run continues but does not repeat the saved run's batches."
            )
        return f"rng_state_{rank % saved}.pt"

    def _load_backend_state(self, model: Any, state: Any, path: Path) -> None:
        try:
            self.plugins.load_backend_checkpoint_state(model, state)
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path} does not fit this model: {exc}") from None

    def _weights_replaced(self) -> None:
        for opt in self.prepared.optimizers:
            opt.weights_replaced()
        wait_for_everyone()


# What allow_precision_change lets differ between the save and the load.
PRECISION_KEYS = ("mixed_precision", "fp8_backend")


def rng_state(loader_generators: list[Any] = (), epoch_orders: list[Any] = ()) -> dict[str, Any]:
    """Every RNG a training script draws from: Python's, NumPy's (when installed), torch's, CUDA's,
    the shuffling generators of the prepared dataloaders, and, for a save in the middle of an epoch,
    the state each loader drew that epoch's order from (so a resumed epoch has the same order)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "dataloaders": [g.get_state() if g is not None else None for g in loader_generators],
        "epoch_orders": list(epoch_orders),
    }
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    state.update(cuda_rng_state())
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
    if "cuda" in state:
        set_cuda_rng_states(state["cuda"], state.get("cuda_own"))
