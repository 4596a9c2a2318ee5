"""The model a command studies without training it: built from a transformers config or a
``module:factory`` (on the meta device by default: nothing allocated, nothing downloaded), and
an example batch for it. Used by ``lowbit estimate-memory`` and ``lowbit fp8-payoff``."""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path

import torch
from torch import nn

from lowbit.kernel.errors import ConfigError


def load_model_on_meta(spec: str) -> nn.Module:
    """A model from ``spec`` with its parameters on the meta device (nothing allocated)."""
    return load_model(spec, "meta")


def load_model(spec: str, device: str) -> nn.Module:
    """A model from ``spec`` built on ``device`` (a real one is initialised as its code says,
    buffers included, which ``to_empty`` on a meta model would leave as garbage)."""
    path = Path(spec)
    with torch.device(device):
        if path.exists():
            return _transformers_model(path)
        if ":" in spec:
            module_name, _, factory = spec.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise ConfigError(f"cannot import {module_name!r} (from {spec!r}): {exc}") from None
            if not callable(getattr(module, factory, None)):
                raise ConfigError(f"{module_name!r} has no callable {factory!r}.")
            try:
                model = getattr(module, factory)()
            except TypeError as exc:  # it wants arguments: say so instead of a traceback
                raise ConfigError(
                    f"{spec}: a factory is called with no arguments, and this one needs some ({exc}). "
                    "Point at a function that builds the model."
                ) from None
            if not isinstance(model, nn.Module):
                raise ConfigError(f"{spec} returned a {type(model).__name__}, not an nn.Module.")
            return model
    raise ConfigError(
        f"{spec!r} is neither a transformers config (a config.json or a directory holding one) nor a module:factory."
    )


def _transformers_model(path: Path) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError("a config.json model needs transformers: `pip install transformers`.") from None
    config_file = path / "config.json" if path.is_dir() else path
    try:
        config = transformers.AutoConfig.for_model(**json.loads(config_file.read_text()))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{config_file} is not a transformers config: {exc}") from None
    # An LM head where the model has one (the loss is part of a training step); encoder-decoders
    # as sequence-to-sequence LMs (their labels make the decoder's inputs).
    for auto in (
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForMaskedLM,
        transformers.AutoModelForSeq2SeqLM,
        transformers.AutoModel,
    ):
        with contextlib.suppress(ValueError):
            return auto.from_config(config)
    raise ConfigError(f"transformers has no model class for {config.model_type!r}.")


def example_inputs(
    model: nn.Module, batch_size: int, seq_len: int, device: str = "meta"
) -> dict[str, torch.Tensor] | torch.Tensor:
    """Token ids for a transformers model (labels too, so the loss is part of the graph), else a
    float batch of the first Linear's width, on ``device``."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vocab_size", None):
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        causal_lm = hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None
        return {"input_ids": ids, "labels": ids} if causal_lm else {"input_ids": ids}
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise ConfigError("give a model with an nn.Linear (its width sizes the example batch) or a transformers model.")
    return torch.zeros(batch_size, first.in_features, device=device)
