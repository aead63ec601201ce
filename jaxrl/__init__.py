"""jaxrl: exact, layout-invariant RL and preference fine-tuning of language models in JAX.

Array names carry their shape as axis letters (``logits_BTV``, ``tokens_RMT``); the letters are
defined once, in docs/shapes.md (B rows, T tokens, D width, V vocabulary, H / K query / kv heads,
M micro-batch slots, R data-parallel ranks, G generations per prompt, S segment slots, ...).
Segment ids are 1-based documents within a row; 0 marks padding. Positions restart at 0 for
every document.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["ConfigError", "DPOConfig", "GRPOConfig", "SFTConfig", "__version__"]


def __getattr__(name: str) -> Any:
    """The config classes, imported on first use: ``import jaxrl.cli`` stays light, so the
    command line handles Ctrl-C (and errors) from its first moment."""
    if name in ("ConfigError", "DPOConfig", "GRPOConfig", "SFTConfig"):
        import jaxrl.config

        return getattr(jaxrl.config, name)
    raise AttributeError(f"module 'jaxrl' has no attribute {name!r}")
