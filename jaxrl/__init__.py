"""jaxrl: exact, layout-invariant RL and preference fine-tuning of language models in JAX.

Shape vocabulary, used in names across the package (``logits_BTV``, ``tokens_RKT``):

    B  batch (rows)                T  tokens per row
    D  model width                 V  vocabulary
    H  query heads                 K  kv heads (in model code) / micro-batch slots (in batches)
    Dh head dim                    F  MLP hidden width
    G  generations per prompt      M  micro-batches
    R  data-parallel ranks         S  segments (documents) per row, slot 0 = padding

Segment ids are 1-based documents within a row; 0 marks padding. Positions restart at 0
for every document.
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
