"""Checkpoints: crash-safe files (``files``), a run's training state (``training_state``) and
portable model files (``model_files``).
"""
