"""Rollouts: the KV-cache sampler, reward functions and the GRPO generation buffer."""

from jaxrl.rollout.sampler import Sampler, SampleResult, SamplingParams

__all__ = ["SampleResult", "Sampler", "SamplingParams"]
