"""GRPO rollouts: the generator, the generation buffer and pipeline, the rollout queue (every GRPO
row from generation to the optimizer step), episodes and held-out evaluation; reward functions
in ``rewards/``, tools in ``tools/``. The sampler itself is ``jaxrl.generate`` (re-exported)."""

from jaxrl.generate.sampler import Sampler, SampleResult, SamplingParams

__all__ = ["SampleResult", "Sampler", "SamplingParams"]
