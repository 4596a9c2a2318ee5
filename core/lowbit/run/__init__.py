"""lowbit's own run, between the runtime and a front such as Accelerate's API: its settings
(``settings.py``, with Accelerate's config files and launcher variables read as sources in
``accelerate_config.py``), the plugin manager with the core's built-ins (``plugin_manager.py``),
the plugin choice (``choice.py``, ``recipe_choice.py``), the parallel layout (``layout.py``) and
:class:`~lowbit.run.training_run.TrainingRun`, which builds and wires a run from them."""
