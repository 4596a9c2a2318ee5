"""Resuming from a directory written by Hugging Face Accelerate's ``save_state``.

Accelerate's layout (``accelerate/checkpointing.py``, ``utils/constants.py``): the models as
``model.safetensors`` or ``pytorch_model.bin`` (``model_1.safetensors``, ... for more), the
optimizers as ``optimizer.bin`` (``optimizer_1.bin``, ...), the schedulers as ``scheduler.bin``,
the fp16 scaler as ``scaler.pt``, the registered objects as ``custom_checkpoint_<i>.pkl``, each
process's RNG states and step counter as ``random_states_<rank>.pkl`` and each dataloader's
sampler as ``sampler.bin``: all written with ``torch.save`` (pickle).

lowbit reads every file with ``torch.load(weights_only=True)``, which refuses pickled code: the
state dicts load; the RNG file needs only NumPy's array type, which is allowed for that file
alone; a file that holds objects (``sampler.bin`` is a pickled sampler) is skipped and named,
with what that means for the run. Model and optimizer files that cannot be read are errors.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any, Callable

import torch

from lowbit.kernel.errors import CheckpointError
from lowbit.kernel.notices import note

from lowbit.runtime.checkpoint.cuda_rng import set_cuda_rng_states
from lowbit.runtime.checkpoint.files import check_optimizer_state_fits, check_state_fits, read_safetensors

MODEL_FILES = ("model{suffix}.safetensors", "pytorch_model{suffix}.bin")
# Files whose presence (without lowbit's metadata) marks a directory as Accelerate's.
MARKERS = ("model.safetensors", "pytorch_model.bin", "optimizer.bin", "random_states_0.pkl")


def is_accelerate_checkpoint(directory: Path) -> bool:
    return any((Path(directory) / name).is_file() for name in MARKERS)


def _suffix(index: int) -> str:
    return "" if index == 0 else f"_{index}"


def _load(path: Path, what: str, allow_numpy: bool = False) -> Any:
    """``torch.load`` without running pickled code; a refusal names the file."""
    try:
        if not allow_numpy:
            return torch.load(path, map_location="cpu", weights_only=True)
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure: the caller says what it means
        raise CheckpointError(
            f"{path} ({what}) cannot be read safely: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None


def _numpy_array_globals() -> list[Any]:
    """What a pickled NumPy array (NumPy's RNG state) needs: the array reconstructor and types."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]


def _model_file(directory: Path, index: int) -> Path:
    for pattern in MODEL_FILES:
        path = directory / pattern.format(suffix=_suffix(index))
        if path.is_file():
            return path
    names = " or ".join(p.format(suffix=_suffix(index)) for p in MODEL_FILES)
    raise CheckpointError(
        f"Accelerate checkpoint {str(directory)!r} has no weights for model {index} ({names}); "
        "this run prepared more models than were saved."
    )


def _read_model(path: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(path) if path.suffix == ".safetensors" else _load(path, "model weights")


def load_accelerate_checkpoint(checkpointer: Any, directory: Path, unwrap: Any) -> None:
    """Restore ``checkpointer``'s prepared objects, counters and RNGs from Accelerate's files: every
    file is read and checked against its target first, and only then is anything loaded, so a file
    that cannot be read or does not fit leaves the run as it was."""
    prepared, plugins, rank = checkpointer.prepared, checkpointer.plugins, checkpointer.facts.process_index
    loads: list[Callable[[], Any]] = []  # run once everything was read and checked
    for i, model in enumerate(prepared.models):
        path = _model_file(directory, i)
        plain = unwrap(model)
        state = plugins.decode_checkpoint_state("model", plain, _read_model(path))
        check_state_fits(plain, state, path)
        loads.append(functools.partial(plain.load_state_dict, state))
    for i, opt in enumerate(prepared.optimizers):
        path = directory / f"optimizer{_suffix(i)}.bin"
        state = plugins.decode_checkpoint_state("optimizer", opt.optimizer, _load(path, "optimizer state"))
        check_optimizer_state_fits(opt.optimizer, state, path)
        loads.append(functools.partial(opt.load_state_dict, state))
    for i, sched in enumerate(prepared.schedulers):
        loads.append(
            functools.partial(sched.load_state_dict, _load(directory / f"scheduler{_suffix(i)}.bin", "scheduler state"))
        )
    if checkpointer.step_state.precision.scaler is not None and (directory / "scaler.pt").is_file():
        loads.append(
            functools.partial(
                checkpointer.step_state.precision.load_state_dict, _load(directory / "scaler.pt", "fp16 loss scaler")
            )
        )
    for i, obj in enumerate(checkpointer.custom_objects):
        loads.append(
            functools.partial(
                obj.load_state_dict,
                _load(directory / f"custom_checkpoint_{i}.pkl", "an object registered for checkpointing"),
            )
        )
    skipped = [name for name in sorted(p.name for p in directory.glob("sampler*.bin"))]
    rng_path = directory / f"random_states_{rank}.pkl"
    if rng_path.is_file():
        states = _load(rng_path, "RNG states and step", allow_numpy=True)
        loads.append(functools.partial(setattr, checkpointer.counters, "step", int(states.get("step", 0))))
        loads.append(functools.partial(_set_accelerate_rng, states))
    else:
        skipped.append(f"{rng_path.name} (missing: the step counter and RNGs start afresh)")
    for load in loads:
        load()
    if skipped:
        note(
            f"resuming from Accelerate's checkpoint {directory}: skipped {', '.join(skipped)} (a pickled sampler "
            "object: lowbit does not unpickle code; the dataloaders keep lowbit's own shuffling seed)."
        )


def _set_accelerate_rng(states: dict[str, Any]) -> None:
    random.setstate(states["random_state"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "numpy_random_seed" in states:
        import numpy as np

        np.random.set_state(states["numpy_random_seed"])
    if "torch_cuda_manual_seed" in states:
        set_cuda_rng_states(states["torch_cuda_manual_seed"])
