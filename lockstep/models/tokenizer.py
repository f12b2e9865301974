"""Text <-> token ids for every model source, and streaming detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend that Hugging Face's fast tokenizers
use) with what the engine needs besides encode/decode: the BOS rule, the set of ids that end a
generation, the chat template and per-token text for logprob displays. The loaders build the
backend from their format (GGUF metadata, tokenizer.json, or the byte tokenizer of the random
presets); this module knows nothing about formats.

BOS is added by this class, never by the backend's post-processor, so that one flag (`add_bos`)
decides it for every source. Text rendered from a chat template already holds whatever BOS the
template writes: encode it with `add_special_tokens=False` (or call `encode_chat`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import tokenizers
from tokenizers import decoders

from lockstep.errors import RequestError
from lockstep.models.chat_template import compile_chat_template, render_chat_template

# Tokens that end an assistant turn in the chat formats of the supported families (ChatML,
# Llama 3, and the end-of-text tokens that base and older chat models emit). A model's
# eos_token_id often names only one of them (SmolLM2: <|im_end|>; Llama 3 base: <|end_of_text|>),
# yet an instruct model may emit another when it ends a turn, so a chat model stops on any of
# those present in its vocabulary as special tokens.
CHAT_STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>")

_HEX_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are spelled in:
    printable Latin-1 bytes stand for themselves, the rest are shifted to code points 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


@lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    return {ch: b for b, ch in byte_level_alphabet().items()}


def chat_stop_token_ids(backend: tokenizers.Tokenizer) -> set[int]:
    """Ids of the CHAT_STOP_TOKENS that this vocabulary holds as special (added) tokens."""
    special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return {special[name] for name in CHAT_STOP_TOKENS if name in special}


class Tokenizer:
    """A model's tokenizer. Immutable after construction; safe to share between threads."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int] | set[int],
        add_bos: bool,
        chat_template: str | None,
        eos_token_id: int | None = None,
    ) -> None:
        """eos_token_id: the model's own EOS (what templates see as `eos_token`); it must be
        one of eos_token_ids. Defaults to the smallest of them."""
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        if eos_token_id is None and self.eos_token_ids:
            eos_token_id = min(self.eos_token_ids)
        if eos_token_id is not None and eos_token_id not in self.eos_token_ids:
            raise ValueError(f"eos_token_id={eos_token_id} is not in eos_token_ids")
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        if chat_template is not None:
            compile_chat_template(chat_template)  # a broken template fails at load, not per request
        added = backend.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The text of the model's own EOS token (what chat templates see as `eos_token`)."""
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text such as "<|im_start|>" becomes its one id.
        With add_special_tokens, BOS is prepended when the model asks for it (add_bos)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            return [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **template_kwargs: object,
    ) -> str:
        """The prompt text for `messages`, rendered with the model's own template.

        `continue_final_message` (transformers' option of that name): the text ends right
        after the last message's content, with no end-of-turn marker and no generation
        prompt, so the model carries on that message. `template_kwargs` are further
        variables the template reads (Qwen3's `enable_thinking`)."""
        if self.chat_template is None:
            raise RequestError(
                "this model has no chat template; send a plain completion prompt instead"
            )
        if continue_final_message and add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt exclude each other"
            )
        if continue_final_message:
            messages = _tag_final_message(messages)
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )
        return _cut_at_tag(text) if continue_final_message else text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat prompt. No BOS is added: the template writes it
        when the model wants one (as Hugging Face's apply_chat_template(tokenize=True) does)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        """Whether decode(skip_special_tokens=True) drops this token (control tokens)."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for (OpenAI's logprob "bytes" field). A byte-level token
        may hold part of a UTF-8 sequence, so this is bytes, not text. Unknown ids give b""."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            inverse = _byte_level_inverse()
            if all(ch in inverse for ch in piece):
                return bytes(inverse[ch] for ch in piece)
            return piece.encode()
        match = _HEX_BYTE_TOKEN.match(piece)
        if match:  # sentencepiece byte-fallback token
            return bytes([int(match.group(1), 16)])
        return piece.replace(_SPIECE_SPACE, " ").encode()

    def token_str(self, token_id: int) -> str:
        """The token's text for logprob displays. A token that is not valid UTF-8 on its own is
        shown as OpenAI does: "bytes:" followed by its bytes as \\xNN escapes."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


# What `continue_final_message` appends to the final message so that it can find where that
# message ends in the rendered text (transformers' marker, so both cut at the same place).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict]) -> list[dict]:
    """A copy of `messages` whose last message's text (its last text part, for a list) ends
    with _CONTINUE_TAG."""
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
    elif isinstance(content, list) and any(isinstance(p, dict) and "text" in p for p in content):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        last = max(i for i, p in enumerate(parts) if isinstance(p, dict) and "text" in p)
        parts[last]["text"] += _CONTINUE_TAG
        final["content"] = parts
    else:
        raise RequestError("continue_final_message needs text in the final message to continue")
    return [*messages[:-1], final]


def _cut_at_tag(rendered: str) -> str:
    """The rendered text before the marker; a template that strips a message's trailing
    space also strips the marker's, and then the text before it is stripped the same way."""
    if _CONTINUE_TAG.strip() not in rendered:
        raise RequestError(
            "continue_final_message: the final message does not appear in the prompt the chat"
            " template renders (the template changes or drops its text)"
        )
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas whose concatenation equals
    decode(all generated ids), never emitting half of a multi-byte character.

    Only a window of ids is decoded each time: the ids already emitted since the last delta
    ("done") and the new ones. Both decodes start at the same token, so tokenizers that render
    a token differently at the start of a string (sentencepiece's leading space) give the same
    text for the shared part. Text that ends in U+FFFD is an incomplete UTF-8 sequence and is
    held back until a later token completes it, or until flush().

        window:  d d d | n n      done = decode(d d d), full = decode(d d d n n)
                                  delta = full[len(done):]; the window restarts at the n's
    """

    _PROMPT_CONTEXT = 5  # prompt tokens that seed the window, for the leading-space rule

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window: list[int] = list(prompt_ids)[-self._PROMPT_CONTEXT :]
        self._done = len(self._window)

    def _delta(self, final: bool) -> str:
        decode = self._tokenizer.decode
        done = decode(self._window[: self._done], self._skip_special)
        full = decode(self._window, self._skip_special)
        if not final and (len(full) <= len(done) or full.endswith("\ufffd")):
            return ""
        del self._window[: self._done]
        self._done = len(self._window)
        return full[len(done) :]

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete (possibly "")."""
        self._window.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete sequence decodes to U+FFFD)."""
        return self._delta(final=True)
