"""The requests of `lockstep bench throughput` and `lockstep bench serve`: random token
prompts or a JSONL file.

Every length is a fixed number or a range `a:b` (both ends included), drawn per request from
one `random.Random(seed)`, so the same options give the same requests on every machine.
Random prompts draw their tokens from the same generator, uniformly over the vocabulary; with
hundreds of tokens per prompt no two prompts share a prefix, so the prefix cache stays cold.

A prompts file holds one JSON object per line, with the prompt as `"prompt"` or `"text"` (a
string, tokenized as the engine tokenizes text prompts) or as `"prompt_token_ids"` or
`"token_ids"` (a list of ids), and optionally its own `"output_len"`. A text prompt keeps its
text beside its ids, for the routes that take text (`bench serve --api chat`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from lockstep.errors import ConfigError
from lockstep.models.tokenizer import Tokenizer

_TEXT_KEYS = ("prompt", "text")
_ID_KEYS = ("prompt_token_ids", "token_ids")


@dataclass(frozen=True)
class LengthRange:
    """A length: `lo` tokens, or uniformly `lo` to `hi` tokens (both included)."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, option: str) -> LengthRange:
        """'1024' or '512:2048'; anything else is a `ConfigError` naming `option`."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) not in (1, 2) or min(values, default=0) < 1 or values[0] > values[-1]:
            raise ConfigError(f"{option} {text!r} is invalid: expected a number of tokens >= 1 "
                              "or a range a:b with 1 <= a <= b")  # fmt: skip
        return cls(values[0], values[-1])

    def draw(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class BenchRequest:
    """One request of the benchmark: its prompt ids, how many tokens it may generate, and
    the prompt's text where it was given as text (None for token ids)."""

    prompt_ids: list[int]
    output_len: int
    text: str | None = None


def random_requests(
    num_prompts: int, input_len: LengthRange, output_len: LengthRange, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """`num_prompts` prompts of uniformly random token ids (lengths drawn from `input_len`),
    each generating up to a length drawn from `output_len`."""
    _check_count(num_prompts)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        n = input_len.draw(rng)
        prompt = [rng.randrange(vocab_size) for _ in range(n)]
        requests.append(BenchRequest(prompt, output_len.draw(rng)))
    return requests


def file_requests(
    path: Path,
    tokenizer: Tokenizer,
    num_prompts: int | None,
    output_len: LengthRange,
    seed: int,
) -> list[BenchRequest]:
    """The first `num_prompts` prompts of a JSONL file (all of them when None); a line's own
    `output_len` wins over one drawn from `output_len`."""
    if num_prompts is not None:
        _check_count(num_prompts)
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--prompts-file {str(path)!r} cannot be read: {e.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if num_prompts is not None and len(requests) == num_prompts:
            break
        if not line.strip():
            continue
        drawn = output_len.draw(rng)
        requests.append(_parse_line(line, f"{path}:{number}", tokenizer, drawn))
    if not requests or (num_prompts is not None and len(requests) < num_prompts):
        raise ConfigError(f"--prompts-file {str(path)!r} holds {len(requests)} prompts: "
                          f"expected {num_prompts or 'at least 1'}")  # fmt: skip
    return requests


def _parse_line(line: str, where: str, tokenizer: Tokenizer, output_len: int) -> BenchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not a JSON object ({e.msg})") from None
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(item).__name__}")
    text_key = next((k for k in _TEXT_KEYS if k in item), None)
    ids_key = next((k for k in _ID_KEYS if k in item), None)
    if (text_key is None) == (ids_key is None):
        keys = ", ".join(_TEXT_KEYS + _ID_KEYS)
        raise ConfigError(f"{where}: expected exactly one of {keys}")
    if text_key is not None:
        text = item[text_key]
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{where}: {text_key} must be a non-empty string")
        ids = tokenizer.encode(text)
    else:
        text = None
        ids = item[ids_key]
        if not (isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids)):
            raise ConfigError(f"{where}: {ids_key} must be a non-empty list of token ids >= 0")
    out = item.get("output_len", output_len)
    if not (_is_int(out) and out >= 1):
        raise ConfigError(f"{where}: output_len={out!r} is invalid: expected an integer >= 1")
    return BenchRequest(list(ids), out, text)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(num_prompts: int) -> None:
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts {num_prompts} is invalid: expected an integer >= 1")
