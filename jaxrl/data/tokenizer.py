"""Tokenizers: a thin wrapper over HF ``tokenizers`` with the model's chat template, and a
built-in character tokenizer.

Both are the same class: the character tokenizer is an HF ``tokenizers.Tokenizer`` with a
word-level model over single characters, so it saves as a ``tokenizer.json`` that HF loads.
``load_tokenizer(dir)`` reads an HF tokenizer directory the way ``transformers`` does:
``tokenizer.json``, ``tokenizer_config.json`` (special tokens, ``add_bos_token``,
``chat_template``), ``special_tokens_map.json`` and ``chat_template.jinja`` /
``additional_chat_templates/*.jinja`` (docs/data.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxrl.data.chat_template import (
    ChatTemplateError,
    Template,
    assistant_mask,
    compile_template,
)
from jaxrl.runtime import storage

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
# the named special tokens transformers passes to chat templates (``special_tokens_map``)
SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

__all__ = ["ChatTemplateError", "TextTokenizer", "char_tokenizer", "load_tokenizer"]


class UnknownTextError(ValueError):
    """Text holds characters the tokenizer's vocabulary cannot represent."""


class TextTokenizer:
    """Encode/decode text with explicit ``eos_id``/``pad_id``/``bos_id`` (``None`` if absent),
    and render conversations with the tokenizer's chat template(s).

    ``chat_templates``: name → Jinja source (a single template is named ``"default"``);
    ``special_tokens``: the named special tokens templates see (``bos_token``, ...);
    ``add_bos_token``: whether plain text starts with ``bos`` (``None``: ask the tokenizer's
    post-processor); ``config``/``files``: the source directory's ``tokenizer_config.json`` and
    template files, written back by ``save``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token: str,
        pad_token: str | None = None,
        bos_token: str | None = None,
        chat_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
        origin: str = "the tokenizer",
        config: Mapping[str, Any] | None = None,
        files: Mapping[str, str] | None = None,
    ):
        self._tok = tokenizer
        self.eos_id = self._require(eos_token, "eos_token")
        self.pad_id = self._require(pad_token, "pad_token") if pad_token else self.eos_id
        self.bos_id = self._require(bos_token, "bos_token") if bos_token else None
        self.chat_templates = dict(chat_templates or {})
        named = {"eos_token": eos_token, "pad_token": pad_token, "bos_token": bos_token}
        self.special_tokens = dict(special_tokens or {k: v for k, v in named.items() if v})
        self.origin = origin
        self._config = dict(config or {})
        self._files = dict(files or {})
        if add_bos_token is None:  # what the post-processor does to plain text
            probe = self._tok.encode("a", add_special_tokens=True).ids
            add_bos_token = self.bos_id is not None and probe[:1] == [self.bos_id]
        self.add_bos_token = bool(add_bos_token)
        unk = getattr(self._tok.model, "unk_token", None)
        self.unk_id = self._tok.token_to_id(unk) if unk else None  # None: every text encodes
        self.allow_unknown = False  # True: unrepresentable text becomes unk (counted) instead
        self.unknown_count = 0  # unk tokens produced while allow_unknown is True

    def _require(self, token: str, role: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise ValueError(f"{role} {token!r} is not in the tokenizer's vocabulary")
        return idx

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` without special tokens; ``add_bos`` prepends ``bos_id``."""
        ids = self._ids(text)
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def _ids(self, text: str) -> list[int]:
        """Token ids of ``text``; text the vocabulary cannot represent (it would become the unk
        token) raises ``UnknownTextError`` naming the characters, unless ``allow_unknown``."""
        enc = self._tok.encode(text, add_special_tokens=False)
        if self.unk_id is None or self.unk_id not in enc.ids:
            return enc.ids
        spans = [o for i, o in zip(enc.ids, enc.offsets, strict=True) if i == self.unk_id]
        if self.allow_unknown:
            self.unknown_count += len(spans)
            return enc.ids
        pieces = sorted({text[a:b] for a, b in spans})
        shown = ", ".join(repr(x) for x in pieces[:5]) + (" ..." if len(pieces) > 5 else "")
        raise UnknownTextError(
            f"text {text[:60]!r} holds {len(spans)} piece(s) the tokenizer cannot represent "
            f"({shown}); they would silently become {self._tok.id_to_token(self.unk_id)!r}: "
            "remove them from the data, or use a tokenizer that covers them"
        )

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode(ids, skip_special_tokens=True)

    # -- chat templates ---------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def chat_template(self, tools: Sequence[Any] | None = None) -> Template:
        """The template transformers would pick: ``"tool_use"`` when tools are given and it
        exists, else ``"default"``. Raises ``ChatTemplateError`` when there is none."""
        if not self.chat_templates:
            raise ChatTemplateError(
                f"{self.origin} has no chat template (no chat_template in tokenizer_config.json, "
                f"no {CHAT_TEMPLATE_FILE}), so conversational rows (lists of {{role, content}} "
                "messages) cannot be rendered: use a model directory whose tokenizer has one (an "
                "instruct model's), add a chat_template, or give plain-text rows"
            )
        if tools is not None and "tool_use" in self.chat_templates:
            name = "tool_use"
        elif "default" in self.chat_templates:
            name = "default"
        else:
            raise ChatTemplateError(
                f"{self.origin} has chat templates {sorted(self.chat_templates)} but none named "
                "'default'; name one 'default'"
            )
        origin = self.origin if name == "default" else f"{self.origin} (template {name!r})"
        return Template(self.chat_templates[name], origin, self.special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as text (``apply_chat_template(..., tokenize=False)``)."""
        return self.chat_template(tools).render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation, no special tokens added: equal to
        ``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages,
        add_generation_prompt=..., tokenize=True)``. Note the default ``add_generation_prompt``
        is True here (a prompt for generation), False in transformers."""
        text = self.render_chat(messages, add_generation_prompt, tools, **template_kwargs)
        return self._ids(text)

    def chat_assistant_mask(
        self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """``(ids, mask)``: the whole conversation's ids (no generation prompt) and 1 on the
        tokens of assistant turns (content and end-of-turn token); see
        ``jaxrl.data.chat_template.assistant_mask``."""
        template = self.chat_template()

        def encode_chat(msgs: Sequence[Mapping[str, Any]], add_generation_prompt: bool):
            return self.apply_chat_template(msgs, add_generation_prompt, **template_kwargs)

        return assistant_mask(encode_chat, messages, eos_id=self.eos_id, origin=template.origin)

    def generation_config(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """generation_config.json fields for a model exported with this tokenizer: ``base`` (the
        source checkpoint's, sampling defaults kept) with ``eos_token_id`` listing the id jaxrl's
        sampler stops on first, then ``base``'s other stop ids (e.g. Qwen2.5-Instruct's
        ``<|endoftext|>`` after ``<|im_end|>``), and this tokenizer's pad and bos ids."""
        out = dict(base or {})
        stops = out.get("eos_token_id")
        stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
        eos = list(dict.fromkeys([self.eos_id, *stops]))
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        out["pad_token_id"] = self.pad_id
        if self.bos_id is not None:
            out["bos_token_id"] = self.bos_id
        return out

    # -- files ------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and the chat-template files (HF
        layout) into a directory; a loaded tokenizer writes back what it read."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        config = dict(self._config)
        special = {
            "eos_token": self._tok.id_to_token(self.eos_id),
            "pad_token": self._tok.id_to_token(self.pad_id),
        }
        if self.bos_id is not None:
            special["bos_token"] = self._tok.id_to_token(self.bos_id)
        for key, value in special.items():
            config.setdefault(key, value)
        config.setdefault("add_bos_token", self.add_bos_token)
        if self.chat_templates and not self._files and "chat_template" not in config:
            config["chat_template"] = (
                self.chat_templates["default"]
                if list(self.chat_templates) == ["default"]
                else [{"name": k, "template": v} for k, v in self.chat_templates.items()]
            )
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        for name, text in self._files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text, encoding="utf-8")


def _token_name(value: Any) -> str | None:
    """A special token given as a string or as an ``AddedToken`` dict (``{"content": ...}``)."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _chat_templates(
    d: Path, cfg: Mapping[str, Any], cfg_path: Path
) -> tuple[dict[str, str], dict[str, str], str]:
    """``(templates, files, origin)`` as transformers resolves them: ``chat_template.jinja`` and
    ``additional_chat_templates/*.jinja`` when present, else the config's ``chat_template`` (a
    string, or a list of ``{name, template}``)."""
    templates: dict[str, str] = {}
    files: dict[str, str] = {}
    jinja = d / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        files[CHAT_TEMPLATE_FILE] = templates["default"] = jinja.read_text(encoding="utf-8")
    extra = d / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            name = f"{CHAT_TEMPLATE_DIR}/{path.name}"
            files[name] = templates[path.name.removesuffix(".jinja")] = path.read_text("utf-8")
    if templates:
        origin = str(jinja if jinja.is_file() else extra)
        return templates, files, origin
    value = cfg.get("chat_template")
    origin = f"{cfg_path} (chat_template)"
    if value is None:
        return {}, {}, origin
    if isinstance(value, str):
        return {"default": value}, {}, origin
    if isinstance(value, list) and all(
        isinstance(t, Mapping)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}, {}, origin
    raise ValueError(
        f"{cfg_path}: chat_template must be a string or a list of {{name, template}} objects, "
        f"got {type(value).__name__}"
    )


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """The tokenizer of a local HF directory (nothing is downloaded): ``tokenizer.json``,
    special tokens (strings or ``AddedToken`` dicts) from ``tokenizer_config.json`` (and the
    legacy ``special_tokens_map.json``), ``add_bos_token``, and the chat template(s)."""
    d = Path(storage.local(directory))  # a URL (gs://...): its local copy
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
    cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    map_path = d / "special_tokens_map.json"
    legacy = _read_json(map_path) if map_path.is_file() else {}
    special = {}
    for key in SPECIAL_NAMES:
        name = _token_name(cfg.get(key, legacy.get(key)))
        if name is not None:
            special[key] = name
    if "eos_token" not in special:
        raise ValueError(
            f"{str(cfg_path)!r} does not name an eos_token; jaxrl needs one to stop generation"
        )
    templates, files, origin = _chat_templates(d, cfg, cfg_path)
    for name, source in templates.items():
        try:
            compile_template(source)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise ChatTemplateError(f"{origin}: chat template {name!r} does not parse: {e}") from e
    add_bos = cfg.get("add_bos_token")
    return TextTokenizer(
        tok,
        eos_token=special["eos_token"],
        pad_token=special.get("pad_token"),
        bos_token=special.get("bos_token"),
        chat_templates=templates,
        special_tokens=special,
        add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        origin=origin if templates else str(d),
        config=cfg,
        files=files,
    )


def char_tokenizer(
    alphabet: str, *, added_tokens: Sequence[str] = (), chat_template: str | None = None
) -> TextTokenizer:
    """A character-level tokenizer: ids 0..3 are pad, eos, bos, unk; then one id per character,
    then one per ``added_tokens`` entry (multi-character tokens, e.g. ``<tool_call>``, matched
    before the characters and kept by ``decode``); ``chat_template``: its default template."""
    chars = list(dict.fromkeys(alphabet))
    specials = [PAD, EOS, BOS, UNK]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    # the built-in tasks start every document with bos, and an export says so for real-data runs;
    # the post-processor makes transformers add it too (as Llama tokenizers ship)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    return TextTokenizer(
        tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=BOS,
        add_bos_token=True,
        chat_templates={"default": chat_template} if chat_template else None,
    )
