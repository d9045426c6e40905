"""The engines behind the client: plain classes, importable without Ray, DeepSpeed, vLLM or transformers (those load
when an engine is built). ``TrainingEngine`` (``arctic_rl.engines.training``), ``LogProbEngine``
(``arctic_rl.engines.log_prob``), ``SamplingEngine`` (``arctic_rl.engines.sampling``)."""

__all__: list[str] = []
