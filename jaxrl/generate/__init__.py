"""Generation: the continuous-batching sampler and its engine, sampling, sampler weights, stop
strings and the cache geometry; the rollout interface the trainers use (docs/rollout.md)."""
