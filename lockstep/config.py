"""One frozen, validated engine configuration.

Every invalid value or combination is refused in `__post_init__` with a `ConfigError` whose
one-line message names the option, the value given and what is accepted. Derived values are
properties; the config is never mutated after construction. `EngineConfig.from_options`
filters user options through `dataclasses.fields` so that an unknown option is an error too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lockstep.errors import ConfigError

MODES = ("deterministic", "fast")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct, GGUF)
    mode: str = "deterministic"
    device: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    kv_tokens: int | None = None  # KV pool size in tokens; None: from kv_memory_fraction
    kv_memory_fraction: float = 0.3  # of free device memory (CUDA) or of total RAM (CPU)
    max_model_len: int | None = None  # context limit; None: the model's own
    max_batch_tokens: int = 1024  # tokens per forward step, prefill and decode together
    chunk_size: int = 512  # most prompt tokens one request prefills in one step
    max_running: int = 64  # most requests running (holding KV) at once
    enable_prefix_cache: bool = True
    cuda_graphs: bool = True
    num_threads: int | None = None  # CPU threads; None: torch's default
    random_seed: int = 0  # weights of random-weight presets
    debug_checks: bool = False  # check cache integrity after every step
    # Launch the next pure-decode step before the current one's tokens reach the host (see
    # Engine.step); same outputs, the host's per-step work overlaps the GPU. None: on for
    # CUDA (docs/design.md, "Overlapped decode"), off on the CPU, where launching is computing
    # and there is nothing to overlap.
    overlap_decode: bool | None = None

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        if self.kv_tokens is not None:
            _positive_int("kv_tokens", self.kv_tokens)
        if not (
            isinstance(self.kv_memory_fraction, (int, float))
            and 0 < self.kv_memory_fraction <= 0.95
        ):
            raise ConfigError(
                f"kv_memory_fraction={self.kv_memory_fraction!r} is invalid: expected a number in (0, 0.95]"
            )
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _positive_int("max_batch_tokens", self.max_batch_tokens)
        _positive_int("chunk_size", self.chunk_size)
        _positive_int("max_running", self.max_running)
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if self.overlap_decode is not None and not isinstance(self.overlap_decode, bool):
            raise ConfigError(
                f"overlap_decode={self.overlap_decode!r} is invalid: expected true, false or"
                " null (on for CUDA)"
            )
        if not isinstance(self.random_seed, int) or self.random_seed < 0:
            raise ConfigError(
                f"random_seed={self.random_seed!r} is invalid: expected an integer >= 0"
            )
        if self.chunk_size > self.max_batch_tokens:
            raise ConfigError(
                f"chunk_size={self.chunk_size} is invalid with max_batch_tokens={self.max_batch_tokens}:"
                " expected chunk_size <= max_batch_tokens"
            )
        if self.max_running > self.max_batch_tokens:
            raise ConfigError(
                f"max_running={self.max_running} is invalid with max_batch_tokens={self.max_batch_tokens}:"
                " every running request needs a token of the step budget to decode,"
                " expected max_running <= max_batch_tokens"
            )

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from user options; an unknown option is a `ConfigError` listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown engine option {unknown[0]!r}: accepted options are {', '.join(sorted(known))}"
            )
        return cls(**options)

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device == "cuda" else "float32"

    @property
    def use_cuda_graphs(self) -> bool:
        return self.cuda_graphs and self.resolved_device == "cuda"

    @property
    def use_overlap_decode(self) -> bool:
        if self.overlap_decode is not None:
            return self.overlap_decode
        return self.resolved_device == "cuda"


def _choice(name: str, value: object, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ConfigError(f"{name}={value!r} is invalid: expected one of {', '.join(accepted)}")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer >= 1")
