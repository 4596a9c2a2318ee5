"""The plugins one run chose, with one typed method per routed hook.

pluggy calls every implementation of a hook; lowbit calls only the chosen plugin's, found once and
then called as a plain function. Each method here routes to the plugin chosen for its role (the
low-precision backend, the distributed strategy), passes the run's context, and checks what the
plugin returns, so that a wrong result names the plugin and the hook instead of failing far away.
The run's parts (preparation, checkpoints) receive this object, not the run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from lowbit.kernel.errors import PluginError
from lowbit.kernel.types import ConversionReport, ConvertedModel, PrepareContext, StrategyIntegration

if TYPE_CHECKING:
    import torch

    from lowbit.kernel.layer_roles import LayerRoles
    from lowbit.kernel.manager import LowbitPluginManager
    from lowbit.kernel.registry import Selection


def plugin_label(selection: Any) -> str:
    """``low-precision backend 'fakefp8' (lowbit-fakefp8 0.1.0)``: who to blame in an error about a hook's result."""
    description = selection.chosen.description
    where = f" ({description.distribution} {description.version})".rstrip() if description.distribution else ""
    return f"{description.LABEL} {description.name!r}{where}"


def name_the_plugin(exc: BaseException, selection: Any, hook: str) -> None:
    """Add which plugin's hook raised ``exc`` to it as it travels up (a note under its traceback,
    Python 3.11+): a backend's own error often names neither the backend nor lowbit."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"lowbit: raised in {hook} of the {plugin_label(selection)}.")


def expect_result(selection: Any, hook: str, result: Any, expected: type, wording: str) -> Any:
    """``result`` when it is None or an ``expected``; otherwise an error naming the plugin and the hook."""
    if result is not None and not isinstance(result, expected):
        raise PluginError(f"{plugin_label(selection)}: {hook} returned {type(result).__name__}, expected {wording}.")
    return result


class ChosenPlugins:
    """The low-precision backend (or None) and the strategy (or None) of one run."""

    def __init__(
        self,
        manager: "LowbitPluginManager",
        backend: "Selection | None",
        strategy: "Selection | None",
        context: PrepareContext,
    ) -> None:
        self.manager = manager
        self.backend, self.strategy = backend, strategy
        self.context = context  # the run's plan's, then with what prepare() learned (learned())
        self._callers: dict[tuple[int, str], Callable[..., Any] | None] = {}

    # ------------------------------------------------------------------ what was chosen

    @property
    def backend_name(self) -> str | None:
        return self.backend.name if self.backend else None

    def learned(self, **facts: Any) -> None:
        """What ``prepare()`` learned (the first loader's batch size, the backend's integration with
        the strategy), in the context handed to the hooks from now on: a new record, the run's
        plan untouched."""
        self.context = dataclasses.replace(self.context, **facts)

    # ------------------------------------------------------------------ routing

    def caller(self, selection: "Selection | None", hook: str) -> Callable[..., Any] | None:
        """The chosen plugin's own implementation of ``hook`` as a plain function taking keyword
        arguments and returning its answer (None: no plugin chosen, or it does not implement the
        hook). Looked up once: a routed hook reaches one plugin, so calling its implementation
        directly is what pluggy would do, without pluggy's per-call filtering of every registered
        plugin (which dynamo cannot trace, and which every step would pay)."""
        if selection is None or selection.chosen is None:
            return None
        plugin = selection.chosen.plugin
        key = (id(plugin), hook)
        if key not in self._callers:
            caller = getattr(self.manager.hook, hook)
            impls = [impl for impl in caller.get_hookimpls() if impl.plugin is plugin]
            self._callers[key] = _direct(impls[-1]) if impls else None
        return self._callers[key]

    def implements(self, selection: "Selection | None", hook: str) -> bool:
        return self.caller(selection, hook) is not None

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

    def prepare_model_and_optimizer(
        self, model: "torch.nn.Module", optimizer: Any, layer_roles: "LayerRoles"
    ) -> tuple[Any, Any]:
        return self._call(
            self.backend, "prepare_model_and_optimizer", model=model, optimizer=optimizer, layer_roles=layer_roles
        )

    def convert_model(
        self, model: "torch.nn.Module", layer_roles: "LayerRoles"
    ) -> "tuple[torch.nn.Module | None, ConversionReport | None]":
        """The converted model (None: unchanged) and the backend's report of it (None: it gave none)."""
        import torch

        try:
            converted = self._call(self.backend, "convert_model", model=model, layer_roles=layer_roles)
        except Exception as exc:
            name_the_plugin(exc, self.backend, "convert_model")
            raise
        wording = "a torch.nn.Module, a ConvertedModel (or None)"
        if isinstance(converted, ConvertedModel):
            expect_result(
                self.backend,
                "convert_model",
                converted.model,
                torch.nn.Module,
                "ConvertedModel.model: a torch.nn.Module",
            )
            expect_result(
                self.backend,
                "convert_model",
                converted.report,
                ConversionReport,
                "ConvertedModel.report: a ConversionReport",
            )
            return converted.model, converted.report
        return expect_result(self.backend, "convert_model", converted, torch.nn.Module, wording), None

    def wrap_optimizer(self, optimizer: Any, model: Any) -> Any:
        import torch

        wrapped = self._call(self.backend, "wrap_optimizer", optimizer=optimizer, model=model)
        return expect_result(
            self.backend, "wrap_optimizer", wrapped, torch.optim.Optimizer, "a torch.optim.Optimizer (or None)"
        )

    def strategy_integration(self) -> StrategyIntegration:
        """What the backend adds to the strategy's own setup (MS-AMP's DeepSpeed integration); a
        dict with the record's field names is taken too (the hook's answer before the record)."""
        if self.strategy is None:
            return StrategyIntegration()
        given = self._call(self.backend, "strategy_integration", strategy=self.strategy.name)
        if isinstance(given, dict):
            fields = set(StrategyIntegration.__dataclass_fields__)
            unknown = sorted(set(given) - fields)
            if unknown:
                raise PluginError(
                    f"{plugin_label(self.backend)}: strategy_integration returned keys {unknown} that "
                    f"StrategyIntegration has no field for; its fields: {', '.join(sorted(fields))}."
                )
            given = StrategyIntegration(**given)
        return (
            expect_result(
                self.backend,
                "strategy_integration",
                given,
                StrategyIntegration,
                "a lowbit.kernel.types.StrategyIntegration (or None)",
            )
            or StrategyIntegration()
        )

    def wrap_for_distribution(self, model: Any, optimizer: Any) -> tuple[Any, Any] | None:
        return self._call(self.strategy, "wrap_for_distribution", model=model, optimizer=optimizer)

    def backend_context_factory(self, model: Any) -> "Callable[[], ContextManager] | None":
        """The backend's forward context for ``model`` (TE's autocast), as the function its
        ``autocast_context`` hook returned once: called on every forward, it returns a fresh context
        manager. None: the backend has no forward context."""
        factory = self._call(self.backend, "autocast_context", model=model)
        if factory is None:
            return None
        if not callable(factory) or (hasattr(factory, "__enter__") and not isinstance(factory, type)):
            raise PluginError(
                f"{plugin_label(self.backend)}: autocast_context returned {type(factory).__name__} {factory!r:.60}, "
                "expected a function of no arguments that returns a context manager (or None). The hook is called "
                "once, "
                "at prepare(); its function runs on every forward (e.g. `return functools.partial(my_library.autocast, "
                "recipe=recipe)`)."
            )
        probe = factory()  # a broken factory would fail at the first forward, far from its cause
        if probe is not None and not (hasattr(probe, "__enter__") and hasattr(probe, "__exit__")):
            raise PluginError(
                f"{plugin_label(self.backend)}: autocast_context's function returned "
                f"{type(probe).__name__} {probe!r:.60}, expected a context manager."
            )
        return factory

    def after_step_work(self, model: Any, optimizer: Any) -> Callable[[], None] | None:
        """What the backend runs after each real optimizer step, as the function its
        ``after_optimizer_step`` hook returned once (None: nothing)."""
        work = self._call(self.backend, "after_optimizer_step", model=model, optimizer=optimizer)
        if work is not None and not callable(work):
            raise PluginError(
                f"{plugin_label(self.backend)}: after_optimizer_step returned {type(work).__name__} "
                f"{work!r:.60}, expected a function of no arguments (or None: no work after a step)."
            )
        return work

    # ------------------------------------------------------------------ training loop

    def clip_grad_norm(self, parameters: list[Any], max_norm: float, norm_type: float) -> Any:
        """A strategy that owns the step (DeepSpeed) first, then the backend; None: lowbit clips."""
        for selection in (self.strategy, self.backend):
            norm = self._call(
                selection, "clip_grad_norm", parameters=parameters, max_norm=max_norm, norm_type=norm_type
            )
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


def _direct(impl: Any) -> Callable[..., Any]:
    """A pluggy ``HookImpl``'s function called with the keyword arguments it names, as pluggy
    passes them (an implementation may take fewer arguments than the spec)."""
    function, names = impl.function, tuple(impl.argnames)

    def call(**kwargs: Any) -> Any:
        return function(**{name: kwargs[name] for name in names if name in kwargs})

    return call
