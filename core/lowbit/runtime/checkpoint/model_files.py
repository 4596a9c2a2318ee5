"""``save_model``'s files, in the layout Accelerate and transformers write and read.

``model.safetensors`` (or ``pytorch_model.bin`` with ``safe_serialization=False``); above
``max_shard_size``, shards named ``model-00001-of-00003.safetensors`` with a
``model.safetensors.index.json`` that maps each weight to its shard. Every file is written
atomically, so an interrupted save never leaves a half-written file under a final name.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from lowbit.kernel.errors import CheckpointError, ConfigError, UnsupportedCombinationError
from lowbit.kernel.notices import note

from lowbit.runtime.checkpoint.files import read_safetensors, write_file_atomically, write_json_atomically

SAFE_WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``10GB`` (decimal, as transformers reads it), ``512MiB`` (binary) or an int."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match or match.group(2) not in _UNITS:
        raise ConfigError(f"max_shard_size must be a number of bytes or a size like '10GB' or '500MiB'; got {size!r}.")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def drop_shared_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """safetensors cannot store two names for one storage (tied embeddings): keep the first name
    of each storage, as transformers does, and say which names were left out."""
    kept, dropped = split_shared_tensors(state)
    if dropped:
        note(
            "save_model left out weights that share memory with another (tied weights; the model "
            f"ties them again when it loads): {', '.join(dropped)}.",
        )
    return kept


def split_shared_tensors(state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The state with the first name of each storage only (contiguous), and the names left out,
    each with the name it shares memory with."""
    seen: dict[tuple, str] = {}
    kept, dropped = {}, []
    for name, tensor in state.items():
        if not torch.is_tensor(tensor):
            kept[name] = tensor
            continue
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            dropped.append(f"{name} (same storage as {seen[key]})")
            continue
        seen.setdefault(key, name)
        kept[name] = tensor.contiguous()
    return kept, dropped


def shard(state: dict[str, Any], max_bytes: int) -> list[dict[str, Any]]:
    """Split into shards of at most ``max_bytes``, in key order, as transformers and Accelerate
    split (so the same model gets the same file names): a tensor larger than the limit gets a
    shard of its own, placed where it comes, and the shard being filled stays open after it."""
    shards: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0
        if nbytes > max_bytes:
            shards.append({name: tensor})
            continue
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _save_safetensors(tensors: dict[str, Any], handle) -> None:
    from safetensors.torch import save

    handle.write(save(tensors, metadata={"format": "pt"}))


def write_model_files(
    state: dict[str, Any], directory: Path, max_shard_size: int | str = "10GB", safe_serialization: bool = True
) -> Path:
    """Write ``state`` into ``directory``; returns the weights file, or the index when sharded."""
    max_bytes = parse_size(max_shard_size)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"save_model writes into a directory, but {directory} is a file.")
    weights_name = SAFE_WEIGHTS if safe_serialization else TORCH_WEIGHTS
    if safe_serialization:
        state = drop_shared_tensors(state)
    serialize = _save_safetensors if safe_serialization else torch.save
    shards = shard(state, max_bytes)
    stem, suffix = weights_name.rsplit(".", 1)
    names = (
        [weights_name]
        if len(shards) == 1
        else [f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}" for i in range(1, len(shards) + 1)]
    )
    index_path = directory / f"{weights_name}.index.json"
    if len(shards) == 1:
        # One file, written atomically; a loader reads it before any index. Then the old set goes.
        write_file_atomically(shards[0], directory / weights_name, serialize)
        index_path.unlink(missing_ok=True)
        _remove_stale_shards(directory, stem, suffix, keep=set())
        return directory / weights_name
    _keep_previous_set_loadable(directory, index_path)
    for name, part in zip(names, shards):
        write_file_atomically(part, directory / name, serialize)
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))},
        "weight_map": {key: name for name, part in zip(names, shards) for key in part},
    }
    write_json_atomically(index, index_path)  # the new set is complete: it becomes the current one
    shutil.rmtree(directory / PREVIOUS_SET_DIR, ignore_errors=True)
    _remove_stale_shards(directory, stem, suffix, keep=set(names))
    return index_path


def read_model_files(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The weights ``write_model_files`` (or Accelerate's or transformers' ``save_pretrained``) wrote:
    a weights file, a directory holding one, or a directory of shards with their index. Pickled
    files are read with ``weights_only=True``: reading runs no code."""
    path = Path(checkpoint)
    if path.is_dir():
        found = [
            path / name
            for name in (f"{SAFE_WEIGHTS}.index.json", f"{TORCH_WEIGHTS}.index.json", SAFE_WEIGHTS, TORCH_WEIGHTS)
            if (path / name).is_file()
        ]
        if not found:
            raise CheckpointError(
                f"{str(path)!r} holds no model weights ({SAFE_WEIGHTS}, {TORCH_WEIGHTS}, or their "
                "sharded index); give the directory save_model wrote, or a weights file."
            )
        path = found[0]
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} does not exist; give the directory save_model wrote, or a weights file.")
    if path.name.endswith(".index.json"):
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        return {key: value for name in shards for key, value in read_model_files(path.parent / name).items()}
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    return torch.load(path, map_location="cpu", weights_only=True)


# Where the previous sharded set waits (hard links: no copy) while a new one is written, so that
# the index always names a complete set: a save killed at any point leaves one that loads.
PREVIOUS_SET_DIR = ".lowbit-previous-weights"


def _keep_previous_set_loadable(directory: Path, index_path: Path) -> None:
    """Before new shards overwrite the names the current index uses: link the current set into
    ``PREVIOUS_SET_DIR`` and point the index there (one atomic replace)."""
    if not index_path.exists():
        return
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        files = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError):
        return  # not an index lowbit can read: the new set replaces it
    previous = directory / PREVIOUS_SET_DIR
    if all(f.startswith(PREVIOUS_SET_DIR + "/") for f in files):
        return  # a killed save already moved it there
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir(parents=True)
    for name in files:
        source = directory / name
        if not source.exists():
            return  # the index names a missing file: nothing complete to keep
        try:
            os.link(source, previous / name)
        except OSError:
            shutil.copy2(source, previous / name)  # a filesystem without hard links
    index["weight_map"] = {key: f"{PREVIOUS_SET_DIR}/{name}" for key, name in index["weight_map"].items()}
    write_json_atomically(index, index_path)


def _remove_stale_shards(directory: Path, stem: str, suffix: str, keep: set[str]) -> None:
    """Shards of an earlier, differently split save would be read with the new index: remove
    those files only (names ``{stem}-NNNNN-of-NNNNN.{suffix}``), nothing else in the directory."""
    if not directory.is_dir():
        return
    pattern = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{re.escape(suffix)}")
    for path in directory.iterdir():
        if pattern.fullmatch(path.name) and path.name not in keep:
            path.unlink()


def tied_as_in(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each name of a parameter the model ties (one Parameter under two names, e.g.
    embeddings and the output layer) holding the same tensor: a strategy that gathers each name on
    its own (FSDP2, ZeRO-3) returns two copies, which would be saved twice."""
    first: dict[int, str] = {}
    for name, tensor in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        original = first.setdefault(id(tensor), name)
        if original != name and name in state and original in state:
            state[name] = state[original]
    return state


def detached_copy(state: dict[str, Any], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor on the CPU, detached from the model: a tensor that is the model's own storage
    is copied, one a strategy gathered already is not (a second copy of a whole model on the main
    process). Names that share one tensor (tied weights) share one copy, as in the model, so
    ``save_model`` writes them once, as Accelerate does."""
    live = {
        ptr
        for t in model.state_dict(keep_vars=True).values()
        if isinstance(t, torch.Tensor)
        for ptr in _cpu_storages(t)
    }
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            key = (
                tensor.device,
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
            )
            if key not in copies or not tensor.numel():
                cpu = tensor.detach().cpu()
                copies[key] = cpu.clone() if cpu.untyped_storage().data_ptr() in live else cpu
            out[name] = copies[key]
    return out


def _cpu_storages(tensor: torch.Tensor) -> Iterator[int]:
    """The CPU memory a model tensor lives in, through tensor subclasses (DTensor, torchao's float8
    weights) by torch's ``__tensor_flatten__`` protocol."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        for attr in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, attr)
            if isinstance(inner, torch.Tensor):
                yield from _cpu_storages(inner)
    elif tensor.device.type == "cpu":
        yield tensor.untyped_storage().data_ptr()


def has_offloaded_params(module: Any) -> bool:
    """Whether ``module`` carries an offloading hook (Accelerate's ``_hf_hook`` with ``offload``,
    as transformers' ``device_map`` loading leaves it): its weights live elsewhere between forwards."""
    return bool(getattr(getattr(module, "_hf_hook", None), "offload", False))


def refuse_weights_not_in_memory(model: torch.nn.Module) -> None:
    """The model files hold the weights the process holds: a model whose weights an offloading
    hook keeps on disk or elsewhere (a device_map dispatch), or left on the meta device, is refused
    before a file is written."""
    offloaded = [name or type(model).__name__ for name, m in model.named_modules() if has_offloaded_params(m)]
    empty = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if offloaded or empty:
        where = (
            f"{len(offloaded)} module(s) offloaded by a device_map hook (first: {offloaded[0]})"
            if offloaded
            else f"{len(empty)} tensor(s) on the meta device (first: {empty[0]})"
        )
        raise UnsupportedCombinationError(
            f"save_model: this model's weights are not all in memory: {where}. lowbit saves the weights it holds and "
            "does not gather offloaded ones. Load the model without offloading (or materialize it: "
            "model.to_empty(device=...) and load its weights), or save it with Accelerate's save_model or "
            "transformers' save_pretrained."
        )
