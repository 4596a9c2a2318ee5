"""Which of Accelerate's test modules run here, and which of their tests test Accelerate's
internals rather than its public API (not counted; the reason beside each)."""

# The modules that run on a CPU with no network (the others need a GPU, a TPU, SageMaker, or
# download models).
MODULES = [
    "test_accelerator.py", "test_compile.py", "test_cpu.py", "test_data_loader.py", "test_dataclasses.py",
    "test_grad_sync.py", "test_kwargs_handlers.py", "test_logging.py", "test_memory_utils.py", "test_metrics.py",
    "test_optimizer.py", "test_scheduler.py", "test_state_checkpointing.py", "test_tracking.py", "test_utils.py",
    "test_imports.py",
]

# test id (module::Class::test, or a prefix of one) -> why it is not counted.
EXCLUDED: dict[str, str] = {}
