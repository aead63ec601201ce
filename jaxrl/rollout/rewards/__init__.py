"""Reward functions: calling them as TRL does, the built-in ones, and loading the ones a
config names (docs/rewards.md)."""
