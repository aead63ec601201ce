"""Mixture of experts (Qwen3-MoE): the sparse block, routing, expert parallelism (docs/moe.md)."""
