"""The plugins one Accelerator chose, with one typed method per routed hook.

pluggy calls every implementation of a hook; lowbit calls only the chosen plugin's. Each method
here routes to the plugin chosen for its role (the precision plugin, the low-precision backend,
the distributed strategy), passes the run's context, and checks what the plugin returns, so that
a wrong result names the plugin and the hook instead of failing far away. Collaborators of the
Accelerator (preparation, checkpoints) receive this object, not the Accelerator.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from lowbit.errors import PluginError
from lowbit.types import ConversionReport, ConvertedModel, PrepareContext

if TYPE_CHECKING:
    import torch

    from lowbit.plugins import LowbitPluginManager
    from lowbit.plugins.selection import Selection


def plugin_label(selection: Any) -> str:
    """``low-precision backend 'fakefp8' (lowbit-fakefp8 0.1.0)``: who to blame in an error about a hook's result."""
    description = selection.chosen.description
    where = f" ({description.distribution} {description.version})".rstrip() if description.distribution else ""
    return f"{description.LABEL} {description.name!r}{where}"


def expect_result(selection: Any, hook: str, result: Any, expected: type, wording: str) -> Any:
    """``result`` when it is None or an ``expected``; otherwise an error naming the plugin and the hook."""
    if result is not None and not isinstance(result, expected):
        raise PluginError(f"{plugin_label(selection)}: {hook} returned {type(result).__name__}, expected {wording}.")
    return result


class ChosenPlugins:
    """The precision plugin, the low-precision backend (or None) and the strategy (or None) of one run."""

    def __init__(self, manager: "LowbitPluginManager", precision: "Selection", backend: "Selection | None",
                 strategy: "Selection | None", context: PrepareContext) -> None:
        self.manager = manager
        self.precision, self.backend, self.strategy = precision, backend, strategy
        self.context = context
        self._callers: dict[tuple[int, str], tuple[Any, Callable[..., Any]]] = {}

    # ------------------------------------------------------------------ what was chosen

    @property
    def backend_name(self) -> str | None:
        return self.backend.name if self.backend else None


    # ------------------------------------------------------------------ routing

    def _routed(self, selection: "Selection | None", hook: str) -> tuple[Any, Callable[..., Any]] | None:
        """pluggy's caller of ``hook`` on the chosen plugin alone, and a function returning its one
        answer (cached: forward calls it every step)."""
        if selection is None or selection.chosen is None:
            return None
        plugin = selection.chosen.plugin
        key = (id(plugin), hook)
        if key not in self._callers:
            others = [p for p in self.manager.get_plugins() if p is not plugin]
            subset = self.manager.subset_hook_caller(hook, remove_plugins=others)

            def answer(**kwargs: Any) -> Any:
                # A routed hook reaches one plugin, so it has one answer or none (no firstresult needed).
                results = subset(**kwargs)
                return results[0] if results else None

            self._callers[key] = (subset, answer)
        return self._callers[key]

    def caller(self, selection: "Selection | None", hook: str) -> Callable[..., Any] | None:
        """A function calling ``hook`` on the chosen plugin alone and returning its answer (None: no answer)."""
        routed = self._routed(selection, hook)
        return None if routed is None else routed[1]

    def implements(self, selection: "Selection | None", hook: str) -> bool:
        routed = self._routed(selection, hook)
        return routed is not None and bool(routed[0].get_hookimpls())

    def _call(self, selection: "Selection | None", hook: str, **kwargs: Any) -> Any:
        caller = self.caller(selection, hook)
        return None if caller is None else caller(context=self.context, **kwargs)

    # ------------------------------------------------------------------ prepare

    def check_compatibility(self) -> None:
        self._call(self.backend, "check_compatibility")
        self._call(self.strategy, "check_compatibility")

    @property
    def converts_model_and_optimizer_together(self) -> bool:
        return self.implements(self.backend, "prepare_model_and_optimizer")

    def prepare_model_and_optimizer(self, model: "torch.nn.Module", optimizer: Any) -> tuple[Any, Any]:
        return self._call(self.backend, "prepare_model_and_optimizer", model=model, optimizer=optimizer)

    def convert_model(self, model: "torch.nn.Module") -> "tuple[torch.nn.Module | None, ConversionReport | None]":
        """The converted model (None: unchanged) and the backend's report of it (None: it gave none)."""
        import torch

        converted = self._call(self.backend, "convert_model", model=model)
        wording = "a torch.nn.Module, a ConvertedModel (or None)"
        if isinstance(converted, ConvertedModel):
            expect_result(self.backend, "convert_model", converted.model, torch.nn.Module, "ConvertedModel.model: a torch.nn.Module")
            expect_result(self.backend, "convert_model", converted.report, ConversionReport, "ConvertedModel.report: a ConversionReport")
            return converted.model, converted.report
        return expect_result(self.backend, "convert_model", converted, torch.nn.Module, wording), None

    def wrap_optimizer(self, optimizer: Any, model: Any) -> Any:
        import torch

        wrapped = self._call(self.backend, "wrap_optimizer", optimizer=optimizer, model=model)
        return expect_result(self.backend, "wrap_optimizer", wrapped, torch.optim.Optimizer, "a torch.optim.Optimizer (or None)")

    def strategy_integration(self) -> dict[str, Any] | None:
        """What the backend adds to the strategy's own setup (MS-AMP's DeepSpeed integration)."""
        if self.strategy is None:
            return None
        return self._call(self.backend, "strategy_integration", strategy=self.strategy.name)

    def wrap_for_distribution(self, model: Any, optimizer: Any) -> tuple[Any, Any] | None:
        return self._call(self.strategy, "wrap_for_distribution", model=model, optimizer=optimizer)

    def autocast_callers(self) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
        """The precision plugin's context (outer, native autocast) and the backend's (inner)."""
        outer = self.caller(self.precision, "autocast_context") if self.context.autocast_dtype is not None else None
        inner = self.caller(self.backend, "autocast_context") if self.implements(self.backend, "autocast_context") else None
        return outer, inner

    def after_optimizer_step_caller(self) -> Callable[..., Any] | None:
        return self.caller(self.backend, "after_optimizer_step") if self.implements(self.backend, "after_optimizer_step") else None

    # ------------------------------------------------------------------ training loop

    @property
    def strategy_owns_backward(self) -> bool:
        return self.implements(self.strategy, "backward")

    def backward(self, loss: "torch.Tensor", model: Any) -> bool:
        return bool(self._call(self.strategy, "backward", loss=loss, model=model))

    def clip_grad_norm(self, parameters: list[Any], max_norm: float, norm_type: float) -> Any:
        """A strategy that owns the step (DeepSpeed) first, then the backend; None: lowbit clips."""
        for selection in (self.strategy, self.backend):
            norm = self._call(selection, "clip_grad_norm", parameters=parameters, max_norm=max_norm, norm_type=norm_type)
            if norm is not None:
                return norm
        return None

    def enable_fp8_telemetry(self, model: Any, recorder: Any) -> bool:
        return bool(self._call(self.backend, "enable_fp8_telemetry", model=model, recorder=recorder))

    # ------------------------------------------------------------------ state

    def full_state_dict(self, model: Any) -> dict[str, Any] | None:
        return self._call(self.strategy, "full_state_dict", model=model)

    def export_state_dict(self, model: Any, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        return self._call(self.backend, "export_state_dict", model=model, state_dict=state_dict)

    def save_checkpoint(self, directory: str, model: Any, optimizer: Any) -> bool:
        return bool(self._call(self.strategy, "save_checkpoint", directory=directory, model=model, optimizer=optimizer))

    def load_checkpoint(self, directory: str, model: Any, optimizer: Any) -> bool:
        return bool(self._call(self.strategy, "load_checkpoint", directory=directory, model=model, optimizer=optimizer))

    def encode_checkpoint_state(self, kind: str, owner: Any, state: dict[str, Any]) -> dict[str, Any]:
        return self._call(self.backend, "encode_checkpoint_state", kind=kind, owner=owner, state=state) or state

    def decode_checkpoint_state(self, kind: str, owner: Any, state: dict[str, Any]) -> dict[str, Any]:
        return self._call(self.backend, "decode_checkpoint_state", kind=kind, owner=owner, state=state) or state

    def backend_checkpoint_state(self, model: Any) -> dict[str, Any] | None:
        return self._call(self.backend, "backend_checkpoint_state", model=model)

    def load_backend_checkpoint_state(self, model: Any, state: dict[str, Any]) -> None:
        self._call(self.backend, "load_backend_checkpoint_state", model=model, state=state)
