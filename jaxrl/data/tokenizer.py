"""Tokenizers: a thin wrapper over HF ``tokenizers`` and a built-in character tokenizer.

Both are the same class: the character tokenizer is an HF ``tokenizers.Tokenizer`` with a
word-level model over single characters, so it saves as a ``tokenizer.json`` that HF loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"


class TextTokenizer:
    """Encode/decode text with explicit ``eos_id``/``pad_id``/``bos_id`` (``None`` if absent)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token: str,
        pad_token: str | None = None,
        bos_token: str | None = None,
    ):
        self._tok = tokenizer
        self.eos_id = self._require(eos_token, "eos_token")
        self.pad_id = self._require(pad_token, "pad_token") if pad_token else self.eos_id
        self.bos_id = self._require(bos_token, "bos_token") if bos_token else None

    def _require(self, token: str, role: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise ValueError(f"{role} {token!r} is not in the tokenizer's vocabulary")
        return idx

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (HF layout) into a directory."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        special = {
            "eos_token": self._tok.id_to_token(self.eos_id),
            "pad_token": self._tok.id_to_token(self.pad_id),
        }
        if self.bos_id is not None:
            special["bos_token"] = self._tok.id_to_token(self.bos_id)
        (d / "tokenizer_config.json").write_text(json.dumps(special, indent=2))


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """Load ``tokenizer.json`` and special tokens (``tokenizer_config.json``) from a dir."""
    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {str(d)!r}: jaxrl loads HF fast tokenizers "
            "from a local directory (nothing is downloaded)"
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(
            f"{path} cannot be read by `tokenizers` ({e}): repair or re-export it"
        ) from None
    cfg_path = d / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except ValueError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e}): repair or re-export it") from None

    def name(key: str) -> str | None:
        v = cfg.get(key)
        return v.get("content") if isinstance(v, dict) else v

    eos = name("eos_token")
    if eos is None:
        raise ValueError(
            f"{str(cfg_path)!r} does not name an eos_token; jaxrl needs one to stop generation"
        )
    return TextTokenizer(
        tok, eos_token=eos, pad_token=name("pad_token"), bos_token=name("bos_token")
    )


def char_tokenizer(alphabet: str) -> TextTokenizer:
    """A character-level tokenizer: ids 0..3 are pad, eos, bos, unk; then one id per character."""
    chars = list(dict.fromkeys(alphabet))
    specials = [PAD, EOS, BOS, UNK]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return TextTokenizer(tok, eos_token=EOS, pad_token=PAD, bos_token=BOS)
