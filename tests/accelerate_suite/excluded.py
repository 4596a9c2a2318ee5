"""Which of Accelerate's test modules run here, and which of their tests are not counted: those
that test Accelerate's internals rather than its public API, its own wording, big-model inference
(which lowbit does not do), or a difference lowbit makes on purpose (docs/coming-from-accelerate.md,
"Deliberate differences"). Each with its reason; the closing table counts them apart."""

# The modules that run on a CPU with no network (the others need a GPU, a TPU, SageMaker,
# model downloads, or test Accelerate's CLI functions and big-model dispatch).
MODULES = [
    "test_accelerator.py",
    "test_compile.py",
    "test_cpu.py",
    "test_data_loader.py",
    "test_dataclasses.py",
    "test_grad_sync.py",
    "test_kwargs_handlers.py",
    "test_logging.py",
    "test_memory_utils.py",
    "test_metrics.py",
    "test_optimizer.py",
    "test_scheduler.py",
    "test_state_checkpointing.py",
    "test_tracking.py",
    "test_utils.py",
    "test_imports.py",
]

PRIVATE = "reads or patches a private attribute of Accelerate's ({}), not public API"
WORDING = (
    "asserts Accelerate's own message text; lowbit raises the same exception type at the same point, in its own words"
)
INFERENCE = (
    "big-model inference dispatch ({}), which lowbit does not do: it raises saying to use Accelerate or transformers"
)
DELIBERATE = "a deliberate difference, in docs/coming-from-accelerate.md: {}"
NO_GLOBAL_STATE = DELIBERATE.format(
    "no process-global state; each Accelerator has its own, and _reset_state() resets nothing"
)

# test id (module::Class::test, or a prefix of parametrized ids) -> why it is not counted.
EXCLUDED: dict[str, str] = {
    "test_accelerator.py::AcceleratorTester::test_partial_state_after_reset": NO_GLOBAL_STATE,
    "test_accelerator.py::AcceleratorTester::test_accelerator_state_after_reset": NO_GLOBAL_STATE,
    "test_accelerator.py::AcceleratorTester::test_is_accelerator_prepared": DELIBERATE.format(
        "prepare() refuses an object it cannot prepare (here a list) with a TypeError naming it"
    ),
    "test_accelerator.py::AcceleratorTester::test_can_pickle_dataloader_0": PRIVATE.format(
        "Accelerator._dataloaders; prepare() returns lowbit's PreparedDataLoader, not a DataLoaderDispatcher"
    ),
    "test_accelerator.py::AcceleratorTester::test_can_pickle_dataloader_1": PRIVATE.format(
        "Accelerator._dataloaders; prepare() returns lowbit's PreparedDataLoader, not a DataLoaderShard"
    ),
    "test_accelerator.py::AcceleratorTester::test_free_memory_dereferences_prepared_components": PRIVATE.format(
        "Accelerator._models"
    ),
    "test_accelerator.py::AcceleratorTester::test_prepare_model_twice_does_not_double_wrap": PRIVATE.format(
        "Accelerator._models; preparing a model twice returns it as it is, as tests/test_bad_input.py checks"
    ),
    "test_accelerator.py::AcceleratorTester::test_prepared_objects_are_referenced": PRIVATE.format(
        "Accelerator._models"
    ),
    "test_accelerator.py::AcceleratorTester::test_prepare_model_8bit_cpu_offload_raises_valueerror_not_typeerror": PRIVATE.format(  # noqa: E501 - a test id is one string
        "accelerate.accelerator.is_bitsandbytes_multi_backend_available, patched"
    ),
    "test_accelerator.py::AcceleratorTester::test_save_model_offload_use_pytorch": INFERENCE.format(
        "load_checkpoint_and_dispatch with offload"
    ),
    "test_accelerator.py::AcceleratorTester::test_save_model_offload_use_safetensors": INFERENCE.format(
        "load_checkpoint_and_dispatch with offload"
    ),
    "test_tracking.py::TensorBoardTrackingTest::test_project_dir": WORDING,
    "test_utils.py::UtilsTester::test_has_offloaded_params": INFERENCE.format("accelerate.hooks' offloading hooks"),
    "test_utils.py::UtilsTester::test_honor_type": WORDING,
}

# Checks of Accelerate's launched scripts (script_checks.py) that pass under Accelerate and are not
# counted, each for a difference docs/coming-from-accelerate.md gives (a test pins lowbit's side).
DELIBERATE_CHECKS: dict[str, str] = {
    "test_script::test_reinstantiated_state": NO_GLOBAL_STATE + " (after AcceleratorState._reset_state() an "
    "Accelerator goes on working; tests/test_accelerator.py::test_resetting_the_state_leaves_an_accelerator_working)",
}
