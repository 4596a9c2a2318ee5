"""transformers' ``Trainer`` and TRL's trainers on lowbit, the script unchanged: the patch of their
training modules (``patch.py``, with the list of those modules in ``training_modules.py``) and the
Accelerator a Trainer gets (``trainer_accelerator.py``)."""
