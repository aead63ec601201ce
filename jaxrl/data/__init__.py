"""Data: tokenizers and chat templates, datasets in TRL's formats, packing and scheduling."""

from jaxrl.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["TextTokenizer", "load_tokenizer"]
