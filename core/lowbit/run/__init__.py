"""lowbit's own run, between the runtime and a front such as Accelerate's API. ``run/`` holds the
run: it decides once (settings, plugin choice, layout), wires the parts ``runtime/`` holds, and
drives the loop's verbs (backward, accumulate, clip, autocast, join, save and load); ``runtime/``
holds the parts, each handed only what it needs and none knowing its owner. Its settings
(``settings.py``, with Accelerate's config files and launcher variables read as sources in
``accelerate_config.py``), the plugin manager with the core's built-ins (``plugin_manager.py``),
the plugin choice (``choice.py``, ``recipe_choice.py``), the parallel layout (``layout.py``), the
run's frozen plan made from them (``plan.py``: what the run decided, which nothing writes after),
and :class:`~lowbit.run.training_run.TrainingRun`, which wires the parts from the plan. Two files
speak Accelerate's vocabulary, because a user's Accelerate config is a source of lowbit's
settings: ``accelerate_config.py`` (its config file keys and launcher variables) and ``layout.py``
(its ``ParallelismConfig``, which lowbit takes as the layout's record)."""
