"""What ``prepare()`` does: each object through the chosen plugins, in order.

A model goes through the low-precision backend (conversion, or model and optimizer together),
then the distributed strategy, then gets its forward wrapped in the autocast contexts (and
``torch.compile``); optimizers, schedulers and dataloaders get lowbit's wrappers. It works with
the chosen plugins, the prepared objects and the step state it is given, not with the run.
"""

from __future__ import annotations

import copy
import functools
import types
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from lowbit.kernel import notices
from lowbit.kernel.errors import ConfigError, UnsupportedCombinationError
from lowbit.kernel.layer_roles import LayerRole, classify_layers

from lowbit.runtime.observe.fp8_payoff import report_prediction, report_work
from lowbit.runtime.observe.fp8_report import conversion_report, converted_nothing
from lowbit.runtime.routing import ChosenPlugins, plugin_label
from lowbit.runtime.training import weights_from_rank0
from lowbit.runtime.training.data_loader import LoaderOptions, PreparedDataLoader
from lowbit.runtime.training.operations import convert_to_fp32
from lowbit.runtime.training.prepared import PreparedObjects, PreparedOptimizer, PreparedScheduler, StepState
from lowbit.runtime.training.toolchain import check_compiler_for


@dataclass
class PreparationSettings:
    """What ``prepare`` needs to know of this process and of the user's settings."""

    device: torch.device
    # This process's shard of the data: how many different batches a step reads (the data-parallel
    # size; tensor-parallel ranks share theirs), and which of them is this process's.
    data_parallel_size: int
    data_parallel_rank: int
    loaders: LoaderOptions = field(default_factory=LoaderOptions)
    device_placement: bool = True
    dynamo_backend: str | None = None
    compile_options: dict[str, Any] = field(default_factory=dict)  # torch.compile's mode, fullgraph, ... as given
    regional_compilation: bool = False  # compile each repeated block instead of the whole model
    # What each prepared loader shows as ``.gradient_state``, as Accelerate's loaders do (its GradientState).
    gradient_state: Any = None


def _check_adapters_untouched(model: torch.nn.Module, adapters: dict[str, torch.nn.Module], backend: str) -> None:
    """Adapters train in high precision whatever the backend: a conversion that replaced one is refused."""
    replaced = [name for name, module in adapters.items() if _submodule_or_none(model, name) is not module]
    if replaced:
        raise UnsupportedCombinationError(
            f"The {backend} backend converted {len(replaced)} adapter layer(s) ({', '.join(replaced[:3])}"
            f"{', ...' if len(replaced) > 3 else ''}): lowbit keeps a LoRA/PEFT adapter in high precision (a rank-r "
            "GEMM gains nothing from FP8, and its weights are what the run trains). The backend must leave the "
            "layers its convert_model hook is told are adapters (layer_roles) as they are."
        )


def _submodule_or_none(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _not_wrapped_already(model: Any) -> Any:
    """A model the user wrapped in DDP themselves is unwrapped (lowbit wraps it, once, after the
    low-precision conversion, which must see the plain layers); one already sharded by FSDP is refused."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        notices.note(
            "prepare() got a model already wrapped in DistributedDataParallel; lowbit unwrapped it "
            "(it wraps the model itself, after the low-precision conversion): pass the plain model."
        )
        return model.module
    sharded = [
        cls.__name__ for cls in type(model).__mro__ if cls.__name__ in ("FSDPModule", "FullyShardedDataParallel")
    ]
    if sharded:
        raise UnsupportedCombinationError(
            f"prepare() got a model already sharded ({sharded[0]}); lowbit applies the chosen strategy itself "
            "(distributed_type, or lowbit launch's flags), after the low-precision conversion. Pass the plain model."
        )
    return model


class Preparation:
    """Runs each prepared object through the chosen plugins; what it prepares goes into ``prepared``.
    The FP8 report of each model is said as a lowbit notice (once, on the main rank)."""

    def __init__(
        self, plugins: ChosenPlugins, prepared: PreparedObjects, step_state: StepState, settings: PreparationSettings
    ) -> None:
        self.plugins, self.prepared, self.step_state, self.settings = plugins, prepared, step_state, settings
        # Told each model as prepare() got it, before conversion (the throughput meter copies its structure).
        self.before_conversion: Callable[[torch.nn.Module], None] | None = None

    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers, in any order.

        Returns them in the order given (a single object is returned as itself).
        """
        kinds = [self._kind_of(index, obj) for index, obj in enumerate(objects)]
        # An optimizer prepared before (by an Accelerator since freed, or by another one) is
        # prepared again from the optimizer inside it, as Accelerate wraps it again.
        taken_back_optimizers = {
            id(obj.optimizer)
            for obj, kind in zip(objects, kinds)
            if kind == "optimizer" and isinstance(obj, PreparedOptimizer)
        }
        objects = tuple(
            obj.optimizer if kind == "optimizer" and isinstance(obj, PreparedOptimizer) else obj
            for obj, kind in zip(objects, kinds)
        )
        result = list(objects)
        self.plugins.check_compatibility()

        model_positions = [i for i, k in enumerate(kinds) if k == "model"]
        optimizer_positions = [i for i, k in enumerate(kinds) if k == "optimizer"]
        raw_optimizers = {i: objects[i] for i in optimizer_positions}
        # A model and the optimizers created for it travel together through the joint hooks.
        paired_optimizer = optimizer_positions[0] if len(model_positions) == 1 and optimizer_positions else None
        if len(model_positions) == 1 and self.plugins.context.batch_size is None:
            self.plugins.learned(
                batch_size=next(
                    (getattr(o, "batch_size", None) for o, k in zip(objects, kinds) if k == "dataloader"), None
                )
            )

        for m_index in model_positions:
            model = _taken_back(result[m_index])
            if SHARDED_BY not in model.__dict__:
                model = _not_wrapped_already(model)
            if self.before_conversion is not None:
                self.before_conversion(model)
            self._fill_unloaded_weights(model)
            if not self._strategy_places_model:
                model = model.to(self.settings.device)
            optimizer = raw_optimizers.get(paired_optimizer) if paired_optimizer is not None else None
            if CONVERSION in model.__dict__:  # converted by an earlier preparation: not converted twice
                self._check_converted_alike(model)
                if optimizer is not None and id(optimizer) not in taken_back_optimizers:
                    optimizer = self.plugins.wrap_optimizer(optimizer, model) or optimizer
            else:
                model, optimizer = self._convert_for_backend(model, optimizer)
            if paired_optimizer is not None:
                raw_optimizers[paired_optimizer] = optimizer
            model, optimizer = self._distribute(model, optimizer)
            if paired_optimizer is not None:
                raw_optimizers[paired_optimizer] = optimizer
            result[m_index] = self._wrap_forward(model)
            result[m_index].__dict__[PREPARED] = True
            unwrap(result[m_index]).__dict__[PREPARED] = True
            self.prepared.models.append(result[m_index])
            record = self.prepared.conversion_reports.get(unwrap(result[m_index]))
            report = (
                conversion_report(
                    record,
                    self.plugins.backend_name,
                    self.plugins.context.mixed_precision,
                    self.plugins.context.recipe_runs,
                )
                if self.plugins.backend
                else None
            )
            if report:  # a model with no layer in low precision is worth a warning, not a note
                say = notices.warn if converted_nothing(record) else notices.note
                say(report)

        if self.plugins.backend is not None and paired_optimizer is None:
            for index in optimizer_positions:  # optimizers prepared without their model
                raw_optimizers[index] = (
                    self.plugins.wrap_optimizer(raw_optimizers[index], None) or raw_optimizers[index]
                )
        for index in optimizer_positions:
            result[index] = self._prepare_optimizer(raw_optimizers[index])

        replaced = {id(objects[i]): result[i] for i in optimizer_positions}
        for index, kind in enumerate(kinds):
            if kind == "scheduler":
                result[index] = self._prepare_scheduler(objects[index], replaced)
            elif kind == "dataloader":
                settings = self.settings
                result[index] = PreparedDataLoader(
                    objects[index],
                    settings.device,
                    settings.data_parallel_size,
                    settings.data_parallel_rank,
                    settings.gradient_state,
                    options=settings.loaders,
                    device_placement=settings.device_placement,
                )
                self.prepared.dataloaders.append(result[index])
        return result[0] if len(result) == 1 else tuple(result)

    def _fill_unloaded_weights(self, model: torch.nn.Module) -> None:
        """A model whose weights only rank 0 loaded (the others on the meta device) gets rank 0's
        before the backend converts it; a strategy that shards fills the shards itself
        (weights_from_rank0.py)."""
        if self.plugins.context.world_size == 1:
            if weights_from_rank0.unloaded_here(model):
                weights_from_rank0.refuse_unloaded_on_rank0()
            return
        on_zero, elsewhere = weights_from_rank0.ranks_with_unloaded_weights(model)
        if on_zero:
            weights_from_rank0.refuse_unloaded_on_rank0()
        if elsewhere and not self._strategy_places_model:
            weights_from_rank0.broadcast_whole(model, self.settings.device)

    @property
    def _strategy_places_model(self) -> bool:
        strategy = self.plugins.strategy
        return strategy is not None and strategy.chosen.description.places_model

    def _kind_of(self, index: int, obj: Any) -> str:
        mine = any(obj is p for p in (*self.prepared.models, *self.prepared.optimizers))
        if mine:  # prepared here already (a script preparing the model first, then it and its optimizer):
            return "prepared"  # returned as it is, as Accelerate does
        # A model or optimizer prepared before by an Accelerator since freed (Trainer's free_memory()
        # then prepare() at each train()), or by another one (a second Trainer on the same model),
        # is prepared again, as Accelerate does: its wrappers are taken off, it is not converted twice.
        if isinstance(obj, torch.nn.Module):
            return "model"
        if isinstance(obj, (torch.optim.Optimizer, PreparedOptimizer)):
            return "optimizer"
        if obj is None or isinstance(obj, PreparedDataLoader):
            # None (an optional object a script leaves out), or a loader prepared already (here or by
            # another Accelerator): returned as it is, as Accelerate does
            return "prepared"
        if isinstance(obj, torch.utils.data.DataLoader):
            return "dataloader"
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
            hasattr(obj, "step") and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
        ):
            return "scheduler"
        raise TypeError(
            f"prepare() argument {index} is a {type(obj).__module__}.{type(obj).__name__}, which lowbit cannot "
            "prepare. "
            "It takes models (torch.nn.Module), optimizers (torch.optim.Optimizer), dataloaders "
            "(torch.utils.data.DataLoader) and LR schedulers."
        )

    def _convert_for_backend(self, model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
        """The chosen low-precision backend (FP8, FP4, any) converts the model, and for some
        backends the optimizer with it."""
        plugins = self.plugins
        if plugins.backend is None:
            return model, optimizer
        _check_not_laid_out(model, plugin_label(plugins.backend))
        names = _parameter_names(model)
        roles = classify_layers(model)  # decided once, here: every backend and the report read this
        adapters = {name: model.get_submodule(name) for name in roles.named(LayerRole.ADAPTER)}
        if plugins.converts_model_and_optimizer_together:
            model, optimizer = plugins.prepare_model_and_optimizer(model, optimizer, roles)
            _check_adapters_untouched(model, adapters, plugin_label(plugins.backend))
            model.__dict__[CONVERSION] = (self._conversion_identity(), None)
            return model, optimizer
        device_name = plugins.context.hardware.device_name
        work = report_work(model, device_name) if plugins.context.hardware.device_type == "cuda" else None
        try:
            converted, report = plugins.convert_model(model, roles)
        except Exception as exc:
            if not weights_from_rank0.unloaded_here(model):
                raise
            raise ConfigError(
                f"The {plugin_label(plugins.backend)} backend could not convert a model whose weights are not "
                f"loaded on this rank yet (the meta device; the strategy fills them from rank 0 after sharding, "
                f"cpu_ram_efficient_loading): {exc}. Load the weights on every rank for this backend, or use a "
                "backend that converts by shape alone."
            ) from exc
        model = converted if converted is not None else model
        _check_adapters_untouched(model, adapters, plugin_label(plugins.backend))
        model.__dict__[CONVERSION] = (self._conversion_identity(), report)
        if report is not None:
            report.layer_roles = roles
            if report.recipe_runs is not None:  # the backend found its recipe runs otherwise than planned
                plugins.learned(recipe_runs=report.recipe_runs)
            costs = plugins.backend.chosen.description.recipe_costs
            report.predicted = report_prediction(
                work, device_name, report.recipe, costs, report.kept_high_precision(), plugins.context.compiled
            )
            self.prepared.conversion_reports[model] = report
        if optimizer is not None:
            _remap_optimizer_params(optimizer, names, model)
            optimizer = plugins.wrap_optimizer(optimizer, model) or optimizer
        return model, optimizer

    def _conversion_identity(self) -> str:
        """What a conversion was made with: a model converted before is prepared again only with the same."""
        plugins = self.plugins
        if plugins.backend is None:
            return f"mixed_precision={plugins.context.mixed_precision!r} (no low-precision backend)"
        context = plugins.context
        return f"{plugin_label(plugins.backend)} for {context.mixed_precision} ({context.backend_options!r})"

    def _check_converted_alike(self, model: torch.nn.Module) -> None:
        """A model converted by an earlier preparation keeps its converted layers: this run must be
        the one that converted them (else they would train in a format this run did not ask for)."""
        converted_by, report = model.__dict__[CONVERSION]
        now = self._conversion_identity()
        if converted_by != now:
            raise ConfigError(
                f"prepare() got a {type(model).__name__} prepared before by a run whose backend converted its layers: "
                f"{converted_by}. This Accelerator's settings are {now}, so its layers would train in a format "
                "this run did not ask for. Prepare a fresh copy of the model (one that was never prepared), "
                "or use the same mixed_precision and backend settings as the first preparation."
            )
        if report is not None:
            self.prepared.conversion_reports[model] = report

    def _distribute(self, model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
        plugins = self.plugins
        if plugins.strategy is None:
            return model, optimizer
        names = _parameter_names(model)
        sharded_by = model.__dict__.get(SHARDED_BY)
        if sharded_by is not None:  # sharded in place by an earlier preparation: not sharded twice
            if sharded_by != plugin_label(plugins.strategy):
                raise ConfigError(
                    f"prepare() got a {type(model).__name__} laid out in place by an earlier preparation "
                    f"({sharded_by}); this Accelerator's strategy is {plugin_label(plugins.strategy)}. Prepare a "
                    "fresh copy of the model, or use the same strategy as the first preparation."
                )
            if optimizer is not None:
                _remap_optimizer_params(optimizer, names, model)
            return model, optimizer
        plugins.learned(strategy_integration=plugins.strategy_integration())
        wrapped = plugins.wrap_for_distribution(model, optimizer)
        new_model, new_optimizer = wrapped if wrapped is not None else (model, optimizer)
        if new_optimizer is optimizer and optimizer is not None:
            _remap_optimizer_params(optimizer, names, new_model)  # FSDP2 swaps in DTensor parameters
        if new_model is not model and new_model is not None:
            mark_wrapper(new_model, model)
        elif new_model is model:  # laid out in place (FSDP2, tensor parallelism)
            model.__dict__[SHARDED_BY] = plugin_label(plugins.strategy)
        return new_model, new_optimizer

    def prepare_for_evaluation(self, model: torch.nn.Module, place: bool = True) -> torch.nn.Module:
        """A model only evaluated (``prepare_model(evaluation_mode=True)``): on the device (unless
        ``place`` is False: a model transformers already laid out over the devices), its forward in
        the run's precision context, neither converted nor distributed (no gradients to reduce).
        A model given again is returned as it is (its forward is wrapped once)."""
        if model in self.prepared.evaluated or any(model is m for m in self.prepared.models):
            return model
        model = _not_wrapped_already(model)
        prepared = self._wrap_forward(model.to(self.settings.device) if place else model)
        self.prepared.evaluated.append(prepared)
        return prepared

    def _wrap_forward(self, model: torch.nn.Module) -> torch.nn.Module:
        backend = self.settings.dynamo_backend
        compiled = backend not in ("no", "NO", None)
        if compiled:
            advice = check_compiler_for(backend, self.plugins.context.device.type)
            if advice is not None:
                raise ConfigError(advice)
            options = dict(self.settings.compile_options, backend=backend.lower())
            model = (
                compile_blocks_in_place(model, **options)
                if self.settings.regional_compilation
                else torch.compile(model, **options)
            )
        contexts = [
            f
            for f in (self.step_state.precision.autocast_factory(), self.plugins.backend_context_factory(model))
            if f is not None
        ]
        if not contexts:
            return model
        # DDP runs its module's forward: the contexts go there, so that the module itself (what a
        # script, or transformers' Trainer evaluating, calls without DDP) runs in them too, as in
        # Accelerate. A compiled model keeps them outside the compiled region.
        holder = (
            model.module if not compiled and isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        )
        original = holder.forward
        forward = forward_in_contexts(original, *contexts)
        forward.__wrapped__ = original  # type: ignore[attr-defined]
        holder.forward = forward
        holder._lowbit_original_forward = original  # type: ignore[assignment]
        return model

    def _prepare_optimizer(self, optimizer: Any) -> PreparedOptimizer:
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        model = self.prepared.models[-1] if self.prepared.models else None
        prepared = PreparedOptimizer(optimizer, self.step_state, self.plugins.after_step_work(model, optimizer))
        self.prepared.optimizers.append(prepared)
        self.step_state.precision.optimizers_per_step = len(
            self.prepared.optimizers
        )  # fp16's scale: one update per iteration
        return prepared

    def _prepare_scheduler(self, scheduler: Any, replaced: dict[int, PreparedOptimizer]) -> PreparedScheduler:
        prepared_opt = replaced.get(id(scheduler.optimizer))
        if prepared_opt is not None and prepared_opt.optimizer is not scheduler.optimizer:
            # The backend swapped the optimizer (e.g. for one with FP8 states); keep the
            # schedule driving the one that actually steps.
            scheduler.optimizer = prepared_opt.optimizer
            _mark_step_tracked(prepared_opt.optimizer)
        optimizers = [prepared_opt] if prepared_opt is not None else list(self.prepared.optimizers)
        prepared = PreparedScheduler(scheduler, optimizers, self.step_state)
        self.prepared.schedulers.append(prepared)
        return prepared


def _check_not_laid_out(model: torch.nn.Module, backend: str) -> None:
    """A backend converts whole layers; one already split over ranks (DTensor weights) would fail
    mid-forward, mixing its local tensors with the DTensors."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError(
            f"{type(model).__name__} arrives laid out over several processes already (its weights are DTensors, e.g. "
            f"from from_pretrained(tp_plan='auto', device_mesh=...)), but {backend} converts whole layers before they "
            "are "
            "laid out. Load the model without tp_plan/device_mesh and give ParallelismConfig(tp_size=...): lowbit lays "
            "it out with the model's own plan after converting it."
        )


def forward_in_contexts(
    forward: Callable[..., Any], outer: Callable[[], ContextManager], inner: Callable[[], ContextManager] | None = None
) -> Callable[..., Any]:
    """``forward`` run inside the contexts the factories make (the precision's autocast, then the
    backend's), its fp16/bf16 outputs returned in fp32 (the loss is computed outside low precision).
    Plain torch on every call: what each context is was decided when the factories were made."""
    if inner is None:

        def run(*args: Any, **kwargs: Any) -> Any:
            with outer():
                output = forward(*args, **kwargs)
            return convert_to_fp32(output)
    else:

        def run(*args: Any, **kwargs: Any) -> Any:
            with outer(), inner():
                output = forward(*args, **kwargs)
            return convert_to_fp32(output)

    return run


WRAPPED_MODEL = "_lowbit_wrapped_model"
# Facts an earlier preparation left on a model object, so that preparing it again (after
# free_memory(), or in another Accelerator) neither converts nor shards it twice. Kept in the
# instance's __dict__: a copy of the model (deepcopy) is as converted as the model itself.
PREPARED = "_lowbit_prepared"  # on the model prepare() returned and on the model inside its wrappers
CONVERSION = "_lowbit_conversion"  # (what converted the model, its ConversionReport or None)
SHARDED_BY = "_lowbit_sharded_by"  # the strategy that laid the model out in place (FSDP2's fully_shard)


def _taken_back(model: torch.nn.Module) -> torch.nn.Module:
    """A model prepared before, as it was inside that preparation's wrappers (the distributed
    wrapper, the compiled one, the autocast forward); any other model as it is."""
    if PREPARED not in model.__dict__:
        return model
    return unwrap(model, keep_fp32_wrapper=False)


def mark_wrapper(wrapper: torch.nn.Module, model: torch.nn.Module) -> None:
    """Remember which model a strategy's wrapper holds (DDP, DeepSpeed's engine, a third party's),
    so ``unwrap_model`` finds it without knowing the wrapper's class. Kept out of ``_modules``
    (no second copy of the weights in the state dict)."""
    wrapper.__dict__[WRAPPED_MODEL] = model


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the items of each ModuleList whose items share one class (a
    transformer's layers), outermost lists only."""
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if len({type(item) for item in module}) == 1:
            found.extend(module)
            inside.update(id(m) for item in module for m in item.modules())
    return found


def compile_blocks_in_place(model: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Regional compilation of a model lowbit prepares: each repeated block compiled in place
    (``nn.Module.compile``: names, state dicts and the strategy's hooks stay as they are), one
    compiled graph serving every block of the same shape; a model without repeated blocks is
    compiled whole."""
    blocks = repeated_blocks(model)
    if not blocks:
        return torch.compile(model, **compile_kwargs)
    for block in blocks:
        block.compile(**compile_kwargs)
    return model


def compile_regions(model: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Accelerate's ``compile_regions``: a twin of ``model`` whose repeated blocks are compiled
    (``torch.compile`` wrappers), sharing the parameters; ``model`` itself is left as it is and is
    the twin's ``_orig_mod``. Methods bound to a copied module are bound to its twin. A model
    without repeated blocks is compiled whole."""
    blocks = {id(block) for block in repeated_blocks(model)}
    if not blocks:
        return torch.compile(model, **compile_kwargs)

    def twin_of(module: torch.nn.Module) -> torch.nn.Module:
        twin = copy.copy(module)  # its own attribute table; parameters and buffers shared
        twin.__dict__["_modules"] = dict(module._modules)
        for name, value in module.__dict__.items():
            if isinstance(value, types.MethodType) and value.__self__ is module:
                twin.__dict__[name] = types.MethodType(value.__func__, twin)
        for name, child in module._modules.items():
            if child is not None and id(child) in blocks:
                twin._modules[name] = torch.compile(child, **compile_kwargs)
            elif child is not None and any(id(m) in blocks for m in child.modules()):
                twin._modules[name] = twin_of(child)
        return twin

    twin = twin_of(model)
    twin.__dict__["_orig_mod"] = model  # not a submodule: no second copy of the weights in its state dict
    return twin


def unwrap(model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = False) -> torch.nn.Module:
    """The model without distributed/compile wrappers (and without the autocast forward if asked:
    lowbit's, or one a script put there keeping the old one as ``_original_forward``).
    ``keep_torch_compile``: a compiled model comes back compiled, as Accelerate's ``unwrap_model``
    does; with a distributed wrapper inside the compiled one, a new compiled wrapper (same compile
    settings) over the inner model, so that the model being trained is left as it is."""
    compiled = model if hasattr(model, "_orig_mod") else None
    while True:
        if not keep_fp32_wrapper:
            _drop_forward_wrapper(model)
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif WRAPPED_MODEL in model.__dict__:
            model = model.__dict__[WRAPPED_MODEL]
        elif isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):  # the user's own
            model = model.module
        elif not keep_torch_compile or compiled is None or compiled._orig_mod is model:
            return compiled if keep_torch_compile and compiled is not None else model
        else:
            return type(compiled)(model, compiled.dynamo_ctx)


def _drop_forward_wrapper(model: torch.nn.Module) -> None:
    """The autocast forward taken off ``model`` (lowbit's, or one a script put there keeping the old
    one as ``_original_forward``)."""
    original = model.__dict__.pop("_lowbit_original_forward", None) or model.__dict__.pop("_original_forward", None)
    if original is not None:
        if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is type(model).forward:
            model.__dict__.pop("forward", None)  # the class's own forward again (and the model pickles)
        else:
            model.forward = original


def _parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def _remap_optimizer_params(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: torch.nn.Module
) -> None:
    """Point the optimizer at the model's current parameters after a backend replaced them."""
    current = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            replacement = current.get(old_names.get(id(p), ""), p)
            if replacement is not p and p in optimizer.state:
                optimizer.state[replacement] = optimizer.state.pop(p)
            new_params.append(replacement)
        group["params"] = new_params


def _mark_step_tracked(optimizer: torch.optim.Optimizer) -> None:
    """Give a swapped-in optimizer the step marker torch's LRScheduler put on the original, so the
    scheduler does not warn that ``optimizer.step`` was overridden."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]
