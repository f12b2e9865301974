"""Structured outputs compiled and matched by llguidance (the grammar library; Rust, from
PyPI, no other dependency).

`GrammarCompiler` turns a `StructuredOutput` into a matcher for one request, once per request
(compiled grammars are cached by spec). `GrammarState` is that request's matcher: at each step
it writes the request's allowed-token bitmask (a pure function of the spec and the tokens the
request has produced), and it consumes every token the request appends.

JSON schemas and `json_object` are compiled without free whitespace: items are separated by
", " and keys by ": " (Python's `json.dumps` layout), so a constrained output has one spelling
per value and cannot pad itself with whitespace up to max_tokens.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from lockstep.engine.structured_output import StructuredOutput
from lockstep.errors import RequestError

if TYPE_CHECKING:  # the HTTP process compiles grammars too, and never imports torch
    import torch

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of the package: only a broken install lacks it
        raise RequestError(f"structured outputs need llguidance, which is missing ({exc}): "
                           "pip install llguidance") from None  # fmt: skip
    return llguidance


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of an allowed-token bitmask (bit t % 32 of word t // 32)."""
    return (vocab_size + 31) // 32


class _TokenizerView:
    """What llguidance's `TokenizerWrapper` reads from a tokenizer: every id's bytes (ids past
    the tokenizer's vocabulary, padding of the model's, are empty), EOS, BOS, the special ids
    (never matched as text) and an encoder."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        known = min(vocab_size, tokenizer.vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in range(known)]
        self.tokens += [b""] * (vocab_size - known)
        self.special_token_ids = sorted(i for i in range(known) if tokenizer.is_special(i))
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles structured-output specs for one model's tokenizer. Thread-safe (the server
    compiles on its request threads, the engine matches on its own)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(tokenizer.eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """llguidance's tokenizer (built on first use: ~0.1 s for a 50k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                view = llg.TokenizerWrapper(_TokenizerView(self._source, self.vocab_size))
                self._tokenizer = llg.LLTokenizer(view, n_vocab=self.vocab_size,
                                                  eos_token=self.eos_token_ids)  # fmt: skip
            return self._tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """llguidance's grammar for `spec`, checked; a `RequestError` naming spec.field if it
        does not compile."""
        return _compile(self, spec)

    def state(self, spec: StructuredOutput) -> GrammarState:
        """A fresh matcher for one request."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise RequestError(f"{spec.field}: {matcher.get_error()}")
        return GrammarState(matcher, spec, frozenset(self.eos_token_ids))


@lru_cache(maxsize=256)
def _compile(compiler: GrammarCompiler, spec: StructuredOutput) -> str:
    llg = _llguidance()
    try:
        if spec.kind == "json_schema":
            text = llg.LLMatcher.grammar_from_json_schema(spec.spec, overrides=JSON_LAYOUT)
        elif spec.kind == "json_object":
            text = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                          overrides=JSON_LAYOUT)  # fmt: skip
        elif spec.kind == "choice":
            text = llg.grammar_from("choice", json.loads(spec.spec))
        elif spec.kind == "regex":
            text = llg.grammar_from("regex", spec.spec)
        else:
            text = llg.grammar_from("lark" if _is_lark(spec.spec) else "gbnf", spec.spec)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"{spec.field} is not a valid {spec.kind}: {exc}") from None
    error = llg.LLMatcher.validate_grammar(text, compiler.tokenizer)
    if error and not error.startswith("WARNING"):
        raise RequestError(f"{spec.field} is not a valid {spec.kind}: {error.strip()}")
    return text


def _is_lark(text: str) -> bool:
    """GBNF/EBNF writes rules with `::=` (SGLang's `ebnf`, vLLM's `guided_grammar` as
    llama.cpp writes it); Lark with `:`."""
    return "::=" not in text


_EXECUTOR: list[Any] = []


def fill_bitmasks(states: list[tuple[GrammarState, int]], bitmask: torch.Tensor) -> None:
    """Write each state's allowed next tokens into row `index` of `bitmask` (int32 [R,
    bitmask_words], contiguous, on the host): one state on this thread, several on
    llguidance's thread pool (each row depends on its own matcher only)."""
    if len(states) == 1:
        state, index = states[0]
        state.fill_bitmask(bitmask[index])
        return
    if not _EXECUTOR:
        _EXECUTOR.append(_llguidance().LLExecutor())
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    _EXECUTOR[0].unsafe_compute_mask_ptr(
        [(state._matcher, index) for state, index in states],
        bitmask.data_ptr(),
        row_bytes,
        bitmask.shape[0],
    )


class GrammarState:
    """One request's matcher: which tokens may come next, and the tokens that came."""

    def __init__(self, matcher: Any, spec: StructuredOutput, eos: frozenset[int]) -> None:
        self._matcher = matcher
        self.spec = spec
        self._eos = eos
        self.finished_on_text = False  # the last token completed the output as text

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32 [bitmask_words], contiguous, on the
        host). A finished grammar allows only EOS."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> None:
        """Advance past a token the request appended (the mask allowed it)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"{self.spec.field}: token {token} was not allowed: "
                               f"{self._matcher.get_error()}")  # fmt: skip

        # EOS after a complete output ends it; any other token that ends it is text.
        self.finished_on_text = self._matcher.is_stopped() and token not in self._eos

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar can take no further text."""
        return self._matcher.is_stopped()
