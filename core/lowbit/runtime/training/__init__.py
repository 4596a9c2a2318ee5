"""The training run: preparing models, optimizers, schedulers and dataloaders through the chosen
plugins, the prepared wrappers, the collectives, and what decides how a step runs here.
"""
