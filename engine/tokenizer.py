"""Text <-> token ids for an HF checkpoint directory, chat templating, and streaming detokenization.

`Tokenizer` wraps a `tokenizers` tokenizer.json and reads the special tokens, end-of-sequence ids
and chat template from the files HF ships beside it. A detokenizer (`Tokenizer.detokenizer`)
turns a growing list of output ids into text deltas that never split a UTF-8 character:
`ByteLevelDetokenizer` for byte-level BPE (the Qwen family: a table lookup per token),
`IncrementalDetokenizer` for any other decoder (a decode of a short window per push).

Knows nothing about models, sampling or requests: stop conditions beyond `eos_token_ids` (stop
strings, max tokens) belong to the engine. Only renders chat templates; it does not validate
messages beyond what a template itself checks with `raise_exception`.
"""

from __future__ import annotations

import codecs
import json
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A lone U+FFFD at the end of decoded text means the last bytes are an incomplete UTF-8
# character (byte-level BPE splits multi-byte characters across tokens).
REPLACEMENT_CHARACTER = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the
    others (controls, space, ...) for chars from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error


def _token_content(value: str | dict | None) -> str | None:
    """Special tokens appear as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _hf_tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF replaces jinja's tojson, which HTML-escapes and always sorts keys: templates rely on this.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _compile_chat_template(source: str) -> jinja2.Template:
    # The same environment HF builds: chat templates are untrusted code from the Hub.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _hf_tojson
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(source)


def _select_chat_template(value: str | list | None) -> str | None:
    """HF allows a list of named templates; the engine serves the one named "default"."""
    if isinstance(value, list):
        named = {entry["name"]: entry["template"] for entry in value}
        return named.get("default")
    return value


class TooManyTokensError(ValueError):
    """A text longer than the `max_length` it was encoded with; num_tokens: its length."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


class Tokenizer:
    """A loaded tokenizer plus the special-token facts the engine needs."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: tuple[int, ...] = (),
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        source: str = "<memory>",
    ) -> None:
        self._tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self._source = source
        self._compiled_template: jinja2.Template | None = None
        self._token_texts: dict[int, str] = {}  # decode_token's cache

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json and the optional tokenizer_config.json, chat_template.jinja,
        generation_config.json and config.json of an HF checkpoint directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust side raises a bare Exception
            raise ValueError(f"cannot load {tokenizer_file}: {error}") from error

        config = _read_json(path / "tokenizer_config.json")
        eos_token = _token_content(config.get("eos_token"))
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _select_chat_template(config.get("chat_template"))

        # generation_config.json is what HF generate() stops on; config.json is older and only
        # a fallback. The tokenizer's eos token is always a stop token too.
        eos_ids = _as_id_list(_read_json(path / "generation_config.json").get("eos_token_id"))
        if not eos_ids:
            model_config = _read_json(path / "config.json")
            # Multimodal Qwen3.5 configs keep it in text_config.
            for section in (model_config, model_config.get("text_config", {})):
                eos_ids = eos_ids or _as_id_list(section.get("eos_token_id"))
        if eos_token is not None and (eos_token_id := tokenizer.token_to_id(eos_token)) is not None:
            eos_ids.append(eos_token_id)

        return cls(
            tokenizer,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            eos_token=eos_token,
            bos_token=_token_content(config.get("bos_token")),
            pad_token=_token_content(config.get("pad_token")),
            chat_template=chat_template,
            source=str(path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (may be below the model's vocab_size)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (llguidance builds its own from it)."""
        return self._tokenizer.to_str()

    def encode(self, text: str, add_special_tokens: bool = False, max_length: int | None = None) -> list[int]:
        """max_length: past it, raise TooManyTokensError (with the count) without building the
        ids' list: a megabyte of text is ~500k ids, whose list takes ~30 ms in one call holding
        the GIL, a stall of the event loop while a worker thread tokenizes it."""
        # Special-token strings in `text` (e.g. "<|im_start|>" from a chat template) still map to
        # their ids; add_special_tokens only controls the post-processor's BOS/EOS. encode_batch
        # gives the same ids and releases the GIL while it works (encode holds it): a long
        # prompt tokenized in a worker thread then leaves the event loop free.
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_length is not None and len(encoding) > max_length:
            raise TooManyTokensError(len(encoding))
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """decode([token_id]), cached (one entry per vocabulary id at most): every decode step
        of every streaming request decodes its previous token on its own as context."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    def detokenizer(self, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True) -> Detokenizer:
        """A streaming detokenizer for one output; the prompt is context where the decoder needs
        it. skip_special_tokens: as in decode."""
        if self.token_bytes is not None:
            return ByteLevelDetokenizer(self.token_bytes if skip_special_tokens else self.special_token_bytes)
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)

    @cached_property
    def token_bytes(self) -> tuple[bytes, ...] | None:
        """Per token id, the bytes a byte-level BPE decoder makes of it (b"" for special tokens,
        which decode skips), or None when the decoder is anything else. Then decode(ids) is
        exactly the UTF-8 decoding (invalid bytes replaced) of the ids' bytes concatenated.
        The table is checked against decode on every id before it is trusted (0.3 s for a 250k
        vocabulary: EngineCore builds it at start-up); a mismatch gives None, the generic path."""
        if not isinstance(self._tokenizer.decoder, tokenizers.decoders.ByteLevel):
            return None
        alphabet = _byte_level_alphabet()
        to_latin1 = str.maketrans({char: chr(byte) for char, byte in alphabet.items()})
        special = {token.content for token in self._tokenizer.get_added_tokens_decoder().values() if token.special}
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        tokens = [""] * (max(vocab.values(), default=-1) + 1)  # ids without a token decode to ""
        for token, token_id in vocab.items():
            tokens[token_id] = token
        # A token with a char outside the alphabet (an added token's text) stands for its own
        # UTF-8 bytes, as in the decoder.
        table = [b"" if token in special
                 else token.translate(to_latin1).encode("latin-1") if alphabet.keys() >= set(token)
                 else token.encode() for token in tokens]
        decoded = self._tokenizer.decode_batch([[token_id] for token_id in range(len(table))])
        if any(text != raw.decode("utf-8", "replace") for text, raw in zip(decoded, table)):
            return None
        return tuple(table)

    def set_chat_template(self, source: str) -> None:
        """Render chats with `source` from now on (a server's --chat-template); a template that
        does not compile is a ValueError."""
        try:
            compiled = _compile_chat_template(source)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template: {error}") from error
        self.chat_template, self._compiled_template = source, compiled

    @cached_property
    def special_token_bytes(self) -> tuple[bytes, ...] | None:
        """token_bytes with each special token's own text (decode with skip_special_tokens=False:
        a byte-level decoder writes an added token's content as it is)."""
        table = self.token_bytes
        if table is None:
            return None
        table = list(table)
        for token_id, token in self._tokenizer.get_added_tokens_decoder().items():
            if token.special and token_id < len(table):
                table[token_id] = token.content.encode()
        return tuple(table)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Render `messages` to a prompt string (tokenize: its token ids, as HF's tokenize=True
        gives them); kwargs (tools, enable_thinking, ...) reach the template as variables. A
        template's raise_exception or error surfaces as ValueError.
        continue_final_message (HF's and vLLM's): the last message, an assistant's, is left open
        for the model to go on writing: the prompt is cut right after its text (its last text
        part's), before the template closes the turn; found as it is, else stripped (templates
        that trim content)."""
        prompt = self._render(messages, add_generation_prompt, continue_final_message, **kwargs)
        return self.encode(prompt) if tokenize else prompt

    def _render(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                **kwargs: Any) -> str:
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be set: the first "
                                 "continues the final message, the second opens a new one")
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError("continue_final_message needs an assistant message last")
            content = messages[-1].get("content") or ""
            final = content if isinstance(content, str) else (content[-1].get("text") or "") if content else ""
            prompt = self._render(messages, False, False, **kwargs)
            for text in (final, final.strip()):
                if text and (end := prompt.rfind(text)) >= 0:
                    return prompt[:end + len(text)]
            raise ValueError("continue_final_message: the rendered prompt does not show the final message's text, "
                             "so there is nothing to continue")
        if self.chat_template is None:
            raise ValueError(f"tokenizer at {self._source} has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        # Unset special tokens stay undefined (render as ""), as in HF.
        special = {name: value for name, value in
                   (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                    ("pad_token", self.pad_token)) if value is not None}
        try:
            return self._compiled_template.render(
                **special, messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except jinja2.TemplateError as error:  # e.g. a filter applied to a value of the wrong kind
            raise ValueError(f"chat template: {error}") from error


class ByteLevelDetokenizer:
    """Streams the text of a growing output for a byte-level BPE tokenizer: each token is a
    fixed byte string (Tokenizer.token_bytes) and the text is their UTF-8 decoding, so an
    incremental UTF-8 decoder gives exactly decode(output_ids) in pieces, holding back only the
    bytes of an incomplete character. No context, no window, no call into the tokenizer.
    Ids past the table (a model vocabulary larger than the tokenizer's) decode to nothing, as
    in decode."""

    __slots__ = ("_token_bytes", "_held")

    def __init__(self, token_bytes: tuple[bytes, ...]) -> None:
        self._token_bytes = token_bytes
        self._held = b""  # the bytes of an incomplete character at the end so far

    def push(self, token_ids: list[int]) -> str:
        """Append output tokens; return the newly complete text (possibly "")."""
        table = self._token_bytes
        if len(token_ids) == 1 and token_ids[0] < len(table):
            raw = table[token_ids[0]]  # a decode step's one token: no join
        else:
            raw = b"".join([table[token_id] if token_id < len(table) else b"" for token_id in token_ids])
        if self._held:
            raw = self._held + raw
        elif raw.isascii():
            return raw.decode("ascii")  # most tokens: no codec state to keep
        text, used = codecs.utf_8_decode(raw, "replace", False)
        self._held = raw[used:]
        return text

    def flush(self) -> str:
        """Return the text still held back at the end of the output (an incomplete character's
        bytes decode to U+FFFD, as in decode)."""
        text, self._held = self._held.decode("utf-8", "replace"), b""
        return text

    @staticmethod
    def push_all(detokenizers: Sequence[ByteLevelDetokenizer], token_ids: Sequence[list[int]]) -> list[str]:
        """push(token_ids[i]) on detokenizers[i]."""
        return [detokenizer.push(new) for detokenizer, new in zip(detokenizers, token_ids)]


class IncrementalDetokenizer:
    """Streams the text of a growing output, one delta per push, for any decoder.

    vLLM's prefix/read offsets, with the prefix at 0: `_ids[:read]` is a short window of tokens
    already emitted, decoded again only as context; `_ids[read:]` are tokens not yet emitted.
    Each push decodes window + pending and emits the text past the window's own text, unless it
    ends in an incomplete character — then the tokens stay pending. Tokens before the window are
    dropped, so a push costs O(tokens of this and the previous push + tokens held), never
    O(output length).

    Invariant: a window starts and ends on a character boundary (offsets only advance when the
    decoded text ends cleanly), so the deltas concatenate to `decode(output_ids)` exactly.
    """

    # Prompt tokens kept as context: enough for decoders that change a token's text by what
    # precedes it (SentencePiece's leading-space rule), like vLLM's initial offset.
    PROMPT_CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids or [])[-self.PROMPT_CONTEXT_TOKENS:]
        self._read_offset = len(self._ids)

    def push(self, token_ids: list[int]) -> str:
        """Append output tokens; return the newly complete text (possibly "")."""
        return self.push_all([self], [token_ids])[0]

    def flush(self) -> str:
        """Return the text still held back at the end of the output, even if incomplete."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids), final=True)  # never None when final

    @staticmethod
    def push_all(detokenizers: Sequence[IncrementalDetokenizer], token_ids: Sequence[list[int]]) -> list[str]:
        """push(token_ids[i]) on detokenizers[i], for a step's streams at once: their decodes run
        back to back (measured faster than one push per request amid its other bookkeeping).

        Several tokens at once return what pushing them one by one would: their text from one
        decode when it ends on a complete character (the deltas concatenate to it, by the
        invariant); else they go one by one, which still emits the complete text before the
        incomplete character."""
        for detokenizer, new in zip(detokenizers, token_ids):
            detokenizer._ids += new
        texts = [detokenizer._decode(detokenizer._ids) for detokenizer in detokenizers]
        deltas = []
        for detokenizer, new, text in zip(detokenizers, token_ids, texts):
            delta = detokenizer._advance(text, final=False)
            if delta is None and len(new) > 1:
                del detokenizer._ids[-len(new):]
                delta = "".join([detokenizer.push([token_id]) for token_id in new])
            deltas.append(delta or "")
        return deltas

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, text: str, final: bool) -> str | None:
        """Emit `text`, the decode of the window and the pending tokens, past the window's own
        text; None (nothing advances) while it ends in an incomplete character, unless final."""
        ids, read = self._ids, self._read_offset
        if read == len(ids):
            return ""
        if not final and text.endswith(REPLACEMENT_CHARACTER):
            return None
        window_text = self._tokenizer.decode_token(ids[0]) if read == 1 and self._skip_special_tokens \
            else self._decode(ids[:read])
        # The new tokens become the next window; everything before it is no longer needed.
        del ids[:read]
        self._read_offset = len(ids)
        return text[len(window_text):]


Detokenizer = ByteLevelDetokenizer | IncrementalDetokenizer
