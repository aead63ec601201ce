"""The run-level config sections, one concept a module: ``mesh`` (and ``distributed``),
``schedule``, ``optimizer``, ``model`` (and ``model.lora``), ``task`` / ``data``, the outputs
(``checkpoint``, ``export``, ``logging``), ``rollout`` (and ``rollout.vllm``) and
``warm_start``. ``jaxrl.config.run.RunConfig`` composes them with the algorithm's section."""
