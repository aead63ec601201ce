"""Rollouts: the KV-cache sampler, reward functions, the GRPO generation buffer and the
rollout queue (every GRPO row from generation to the optimizer step)."""

from jaxrl.generate.sampler import Sampler, SampleResult, SamplingParams

__all__ = ["SampleResult", "Sampler", "SamplingParams"]
