"""One frozen, validated engine configuration.

Every invalid value or combination is refused in `__post_init__` with a `ConfigError` whose
one-line message names the option, the value given and what is accepted. Derived values are
properties; the config is never mutated after construction. `EngineConfig.from_options`
filters user options through `dataclasses.fields` so that an unknown option is an error too.

Options whose default depends on the device (the KV pool's share of memory, the step budget,
the chunk size, the running cap, overlapped decode) are None unless given and are read through
properties (`resolved_max_running`, `use_overlap_decode`, ...): `DEVICE_DEFAULTS` below.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from lockstep.errors import ConfigError
from lockstep.model_arguments import is_hub_id
from lockstep.numerics import LINEAR_ATTENTION_CHUNK

logger = logging.getLogger(__name__)

# "deterministic" runs the engine's invariant kernels; "reference" runs stock PyTorch (cuBLAS,
# SDPA, oneDNN), the negative control that shows a determinism test can fail. Reference mode
# is not a speed target: on the GPU it decodes slower than deterministic mode (docs/results.md).
MODES = ("deterministic", "reference")
# Old names still accepted by `canonical_mode` (the CLI's --mode, `LLM(mode=...)`,
# `EngineConfig.from_options`), each with a one-line deprecation warning.
MODE_ALIASES = {"fast": "reference"}
TP_REDUCTIONS = ("chunked", "ranks", "all_reduce")  # lockstep.parallel.layers
MAX_TP = 8  # lockstep.parallel.sharding.CHUNKS
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
# The KV cache's element type: "auto" is the model dtype; "fp8_e4m3" stores every K/V value as
# float8_e4m3fn at scale 1.0 (lockstep/ops/fp8.py, "FP8 KV cache"), a byte per value.
KV_DTYPES = ("auto", "fp8_e4m3")
# How hybrid models run the gated delta rule (docs/design.md, "Linear attention"): "recurrent",
# row after row (lockstep/ops/triton/gated_delta.py); "chunked", whole chunk tiles on tensor
# cores (lockstep/ops/triton/chunked_delta.py; on the CPU its torch form). Different bits.
GDN_KERNELS = ("recurrent", "chunked")
# Drafters of exact speculative decoding (docs/speculative.md): "ngram" is prompt lookup,
# "draft" a small model of the same tokenizer (`draft_model`), "mtp" the model's own
# multi-token-prediction layer.
SPECULATIVE_METHODS = ("ngram", "draft", "mtp")


@dataclass(frozen=True)
class DeviceDefaults:
    """What an option left unset (None) means on one device type."""

    kv_memory_fraction: float
    max_batch_tokens: int
    chunk_size: int
    max_running: int
    max_mixed_step_cost: float


# The CPU serves a few sequences at a time: a modest pool (a share of available RAM, capped
# at CPU_DEFAULT_KV_TOKEN_CAP tokens in lockstep/engine/memory.py) and small steps, each of
# which costs what its rows cost (no bound on mixed steps). A GPU server runs batches of
# hundreds (the RL-scale workload: 256 requests of 1k in / 1k out at once): prefill steps of
# 8k tokens, all the device memory left after the weights, the largest step's workspace, the
# CUDA graphs and a fixed headroom goes to the KV pool (lockstep/engine/memory.py). Prompts
# beside streamed decodes are not cut finer by default: a step with prompt rows runs eagerly,
# and more of them cost streams more than they save (lockstep/engine/step_budget.py). The same
# in every mode, so that both modes get the same capacity.
DEVICE_DEFAULTS = {
    "cpu": DeviceDefaults(kv_memory_fraction=0.3, max_batch_tokens=1024, chunk_size=512,
                          max_running=64, max_mixed_step_cost=0.0),
    "cuda": DeviceDefaults(kv_memory_fraction=1.0, max_batch_tokens=8192, chunk_size=4096,
                           max_running=256, max_mixed_step_cost=2.0),
}  # fmt: skip


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct, GGUF)
    revision: str | None = None  # a hub id's branch, tag or commit; None: main
    mode: str = "deterministic"
    device: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    kv_dtype: str = "auto"  # auto: the model dtype; fp8_e4m3: one byte per K/V value
    kv_tokens: int | None = None  # KV pool size in tokens; None: from kv_memory_fraction
    # The four below: None means the device's default (`DEVICE_DEFAULTS`, resolved by the
    # `resolved_*` properties).
    kv_memory_fraction: float | None = None  # share of the memory left for the KV pool
    max_model_len: int | None = None  # context limit; None: the model's own
    max_batch_tokens: int | None = None  # tokens per forward step, prefill and decode together
    chunk_size: int | None = None  # most prompt tokens one request prefills in one step
    max_running: int | None = None  # most requests running (holding KV) at once
    # Admission keeps this share of every running request's remaining output budget free in
    # the KV pool (lockstep/engine/scheduler.py, "Admission"): 1.0 admits only what the pool
    # can carry to its end, so nothing is preempted; 0 admits on the first chunk's slots alone
    # and preempts when the pool runs dry.
    output_reserve: float = 1.0
    # A step that carries prefill rows beside running decodes costs at most this many
    # decode-only steps (lockstep/engine/step_budget.py); 0: no bound, prefill fills the step
    # budget. None: the device's default (2 on CUDA where such steps replay piecewise CUDA
    # graphs, else off: an eager mixed step pays the host's launch work, which finer chunks
    # only multiply).
    max_mixed_step_cost: float | None = None
    enable_prefix_cache: bool = True
    cuda_graphs: bool = True
    # Steps with prompt rows (chunked prefill beside decodes, speculative verify chunks) of
    # up to 1,024 rows replay per-layer CUDA graphs around eager attention, same bits
    # (lockstep/engine/piecewise_graphs.py). None: on wherever CUDA graphs are.
    piecewise_cuda_graphs: bool | None = None
    # Verify steps of exact speculative decoding whose sequences all verify the same number
    # of drafts replay whole-step CUDA graphs, same bits (lockstep/engine/cuda_graphs.py);
    # models with only paged attention, no linear states. Off by default until its GPU tests
    # have run (tests/gpu/test_gpu_speculative.py).
    verify_cuda_graphs: bool = False
    # MLA's attention input (RoPE, cache row, query) as two Triton kernels instead of about
    # 25 torch kernels a layer, the same bits (lockstep/ops/triton/latent_input.py). Off by
    # default until they have run compiled on a GPU (tests/kernels/test_latent_input_triton.py).
    mla_fused_input: bool = False
    num_threads: int | None = None  # CPU threads; None: torch's default
    random_seed: int = 0  # weights of random-weight presets
    debug_checks: bool = False  # check cache integrity after every step
    # Launch the next pure-decode step before the current one's tokens reach the host (see
    # Engine.step); same outputs, the host's per-step work overlaps the GPU. None: on for
    # CUDA (docs/design.md, "Overlapped decode"), off on the CPU, where launching is computing
    # and there is nothing to overlap.
    overlap_decode: bool | None = None
    # Tensor-parallel degree: one process per rank (docs/design.md, "Tensor parallelism").
    # Which degrees a model takes is checked when it is loaded (lockstep.parallel.sharding).
    tp: int = 1
    # Expert parallelism: 1, or tp to spread a mixture-of-experts model's routed experts over
    # the tensor-parallel ranks, each computing its experts whole (lockstep/parallel/experts.py);
    # attention and the dense MLPs stay tensor-parallel. The same bits as tp=1 either way.
    ep: int = 1
    # How row-parallel partial sums are added; None: "chunked" in deterministic mode (the
    # same bits at every degree, TP 1 included), "all_reduce" in reference mode.
    tp_reduction: str | None = None
    # Hybrid models: the radix snapshots' pool, in snapshots (a snapshot: every linear layer's
    # state after a chunk boundary); None: 4 per running request, at most half the memory
    # the caches get (lockstep/engine/memory.py). 0 keeps none: hits resume from position 0.
    linear_snapshots: int | None = None
    # Chunk boundaries kept besides prompt ends, every so many tokens (a multiple of the
    # chunk, 32): a hit resumes at most this many tokens minus one before where it ends, and
    # 511 tokens are a sixteenth of a default CUDA step (lockstep/cache/linear_snapshots.py).
    linear_snapshot_interval: int = 512
    # Mixture-of-experts models: keep every cached token's routed experts beside its KV, so
    # requests may ask for them (`return_routed_experts`, lockstep/cache/routed_experts.py).
    # Costs sparse layers x top_k x 2 bytes per KV token (int16 ids).
    enable_return_routed_experts: bool = False
    # Hybrid models: the gated delta rule's form (`GDN_KERNELS`); part of the numerics, as
    # the mode is. "chunked" is being landed: off by default until it beats "recurrent".
    gdn_kernel: str = "recurrent"
    # Exact speculative decoding (docs/speculative.md): the drafter (None: off), the most
    # draft tokens one verify step checks per request, and the n-gram sizes prompt lookup
    # matches (the longest first). Outputs are the same with or without it.
    speculative: str | None = None
    num_draft_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None  # speculative="draft": the model that drafts (as `model`)

    def __post_init__(self) -> None:
        if self.revision is not None and not (self.model and is_hub_id(self.model)):
            raise ConfigError(
                f"revision={self.revision!r} is invalid with model={self.model!r}: a revision"
                " names a version of a Hugging Face hub id (model='org/name')"
            )
        if self.mode in MODE_ALIASES:
            raise ConfigError(
                f"mode={self.mode!r} is invalid: it is the old name of "
                f"{MODE_ALIASES[self.mode]!r}; EngineConfig.from_options and --mode still take "
                f"it, EngineConfig itself takes one of {', '.join(MODES)}"
            )
        _choice("mode", self.mode, MODES)
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _choice("gdn_kernel", self.gdn_kernel, GDN_KERNELS)
        if self.gdn_kernel == "chunked" and self.mode != "deterministic":
            raise ConfigError(
                f"gdn_kernel='chunked' is invalid with mode={self.mode!r}: expected "
                "mode='deterministic' (reference mode runs the stock torch form)"
            )
        if self.kv_tokens is not None:
            _positive_int("kv_tokens", self.kv_tokens)
        if self.kv_memory_fraction is not None and not (
            _is_number(self.kv_memory_fraction) and 0 < self.kv_memory_fraction <= 1
        ):
            raise ConfigError(
                f"kv_memory_fraction={self.kv_memory_fraction!r} is invalid: expected a number in (0, 1]"
            )
        if not (_is_number(self.output_reserve) and 0 <= self.output_reserve <= 1):
            raise ConfigError(
                f"output_reserve={self.output_reserve!r} is invalid: expected a number in [0, 1]"
            )
        cost = self.max_mixed_step_cost
        if cost is not None and not (_is_number(cost) and (cost == 0 or cost >= 1)):
            raise ConfigError(
                f"max_mixed_step_cost={cost!r} is invalid: expected 0 (no bound) or a number >= 1"
                " (decode-only steps)"
            )
        for name in ("max_model_len", "max_batch_tokens", "chunk_size", "max_running"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        self._check_linear_snapshots()
        if self.piecewise_cuda_graphs is not None and not isinstance(
            self.piecewise_cuda_graphs, bool
        ):
            raise ConfigError(
                f"piecewise_cuda_graphs={self.piecewise_cuda_graphs!r} is invalid: expected "
                "true, false or null (on wherever CUDA graphs are)"
            )
        if not isinstance(self.mla_fused_input, bool):
            raise ConfigError(
                f"mla_fused_input={self.mla_fused_input!r} is invalid: expected true or false"
            )
        if not isinstance(self.verify_cuda_graphs, bool):
            raise ConfigError(
                f"verify_cuda_graphs={self.verify_cuda_graphs!r} is invalid: expected true or false"
            )
        if self.overlap_decode is not None and not isinstance(self.overlap_decode, bool):
            raise ConfigError(
                f"overlap_decode={self.overlap_decode!r} is invalid: expected true, false or"
                " null (on for CUDA)"
            )
        self._check_tp()
        self._check_speculative()
        if not isinstance(self.random_seed, int) or self.random_seed < 0:
            raise ConfigError(
                f"random_seed={self.random_seed!r} is invalid: expected an integer >= 0"
            )
        # The combination is checked as resolved. A default never conflicts with a value given
        # (chunk_size and max_running default to at most max_batch_tokens), so only values
        # given can be refused here.
        budget = self.resolved_max_batch_tokens
        budget_text = f"max_batch_tokens={budget}" + (
            "" if self.max_batch_tokens is not None else f" (the {self._defaults_name} default)"
        )
        if self.resolved_chunk_size > budget:
            raise ConfigError(
                f"chunk_size={self.chunk_size} is invalid with {budget_text}:"
                " expected chunk_size <= max_batch_tokens"
            )
        if self.resolved_max_running > budget:
            raise ConfigError(
                f"max_running={self.max_running} is invalid with {budget_text}:"
                " every running request needs a token of the step budget to decode,"
                " expected max_running <= max_batch_tokens"
            )

    def _check_linear_snapshots(self) -> None:
        count = self.linear_snapshots
        if count is not None and (not isinstance(count, int) or isinstance(count, bool)
                                  or count < 0):  # fmt: skip
            raise ConfigError(
                f"linear_snapshots={count!r} is invalid: expected an integer >= 0 or null "
                "(the default)"
            )
        interval = self.linear_snapshot_interval
        _positive_int("linear_snapshot_interval", interval)
        chunk = LINEAR_ATTENTION_CHUNK
        if interval % chunk:
            raise ConfigError(
                f"linear_snapshot_interval={interval} is invalid: expected a multiple of the "
                f"linear-attention chunk, {chunk} (e.g. {max(chunk, interval // chunk * chunk)})"
            )

    def _check_speculative(self) -> None:
        if self.speculative is not None:
            _choice("speculative", self.speculative, SPECULATIVE_METHODS)
        _positive_int("num_draft_tokens", self.num_draft_tokens)
        _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min={self.prompt_lookup_min} is invalid with prompt_lookup_max="
                f"{self.prompt_lookup_max}: expected prompt_lookup_min <= prompt_lookup_max"
            )
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ConfigError(
                f"speculative={self.speculative!r} is invalid with draft_model="
                f"{self.draft_model!r}: expected speculative='draft' with a draft_model, and a "
                "draft_model only with speculative='draft'"
            )
        if self.speculative is not None and self.overlap_decode:
            raise ConfigError(
                f"overlap_decode=True is invalid with speculative={self.speculative!r}: a "
                "draft needs the tokens before it on the host; expected overlap_decode false or "
                "null"
            )
        if self.speculative == "mtp" and self.tp > 1:
            raise ConfigError(
                f"speculative='mtp' is invalid with tp={self.tp}: the MTP layer runs unsharded; "
                "expected tp=1, or speculative 'ngram' or 'draft'"
            )

    def _check_tp(self) -> None:
        tp = self.tp
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
            raise ConfigError(f"tp={tp!r} is invalid: expected an integer from 1 to {MAX_TP}")
        if self.tp_reduction is not None:
            _choice("tp_reduction", self.tp_reduction, TP_REDUCTIONS)
        ep = self.ep
        if not isinstance(ep, int) or isinstance(ep, bool) or not 1 <= ep <= MAX_TP:
            raise ConfigError(f"ep={ep!r} is invalid: expected an integer from 1 to {MAX_TP}")
        if ep > 1 and ep != tp:
            raise ConfigError(
                f"ep={ep} is invalid with tp={tp}: expert parallelism spreads the experts over "
                f"the tensor-parallel ranks; expected ep=1 or ep={tp} (e.g. --tp {ep} --ep {ep})"
            )
        if tp > 1 and self.overlap_decode:
            raise ConfigError(
                f"overlap_decode=True is invalid with tp={tp}: expected tp=1 (decode steps of a"
                " tensor-parallel engine are not launched ahead)"
            )
        if tp > 1 and self.resolved_device == "cuda":
            import torch

            count = torch.cuda.device_count()
            if tp > count:
                raise ConfigError(
                    f"tp={tp} is invalid: {count} CUDA device(s) are visible, expected tp <= {count}"
                    " (one GPU per rank)"
                )

    @property
    def resolved_tp_reduction(self) -> str:
        if self.tp_reduction is not None:
            return self.tp_reduction
        if self.mode != "deterministic":
            return "all_reduce"
        # TP 1 keeps the one-call linear (its speed); TP 1's bits equal TP 2-8's only with
        # "chunked" asked for (docs/design.md, "Tensor parallelism").
        return "chunked" if self.tp > 1 else "ranks"

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from user options; an unknown option is a `ConfigError` listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown engine option {unknown[0]!r}: accepted options are {', '.join(sorted(known))}"
            )
        if "mode" in options:
            options = dict(options, mode=canonical_mode(options["mode"]))
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
    def resolved_kv_dtype(self) -> str:
        """The KV cache's torch dtype name: the model dtype, or float8_e4m3fn."""
        return "float8_e4m3fn" if self.kv_dtype == "fp8_e4m3" else self.resolved_dtype

    @property
    def _defaults(self) -> DeviceDefaults:
        return DEVICE_DEFAULTS[self.resolved_device]

    @property
    def _defaults_name(self) -> str:
        return "CUDA" if self.resolved_device == "cuda" else "CPU"

    @property
    def resolved_kv_memory_fraction(self) -> float:
        """Share of the memory left for the KV pool when kv_tokens is not given (how the rest
        is computed: lockstep/engine/memory.py)."""
        if self.kv_memory_fraction is not None:
            return float(self.kv_memory_fraction)
        return self._defaults.kv_memory_fraction

    @property
    def resolved_max_mixed_step_cost(self) -> float:
        """0: no bound on a step that carries prefill beside decodes."""
        if self.max_mixed_step_cost is not None:
            return float(self.max_mixed_step_cost)
        return self._defaults.max_mixed_step_cost

    @property
    def resolved_max_batch_tokens(self) -> int:
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return self._defaults.max_batch_tokens

    @property
    def resolved_chunk_size(self) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return min(self._defaults.chunk_size, self.resolved_max_batch_tokens)

    @property
    def resolved_max_running(self) -> int:
        if self.max_running is not None:
            return self.max_running
        return min(self._defaults.max_running, self.resolved_max_batch_tokens)

    def resolved_options(self) -> dict[str, Any]:
        """Every field, with the device-dependent defaults (None) replaced by what they
        resolve to; kv_tokens stays None when the pool is sized from memory."""
        options = dataclasses.asdict(self)
        options.update(
            device=self.resolved_device,
            dtype=self.resolved_dtype,
            kv_memory_fraction=self.resolved_kv_memory_fraction,
            max_batch_tokens=self.resolved_max_batch_tokens,
            chunk_size=self.resolved_chunk_size,
            max_running=self.resolved_max_running,
            max_mixed_step_cost=self.resolved_max_mixed_step_cost,
            overlap_decode=self.use_overlap_decode,
            tp_reduction=self.resolved_tp_reduction,
        )
        return options

    @property
    def use_cuda_graphs(self) -> bool:
        # At tp > 1 decode runs eagerly: captured collectives are for the multi-GPU issue.
        return self.cuda_graphs and self.resolved_device == "cuda" and self.tp == 1

    @property
    def use_piecewise_cuda_graphs(self) -> bool:
        """Asked for (or left to the default) with CUDA graphs on; the engine still runs
        steps with prompt rows eagerly for models the pieces do not take
        (`piecewise_graphs.supports`)."""
        return self.use_cuda_graphs and self.piecewise_cuda_graphs is not False

    @property
    def use_verify_cuda_graphs(self) -> bool:
        """Asked for, with CUDA graphs on; the engine still runs verify steps as other steps
        with prompt rows for models the graphs do not take (hybrid, MLA;
        `piecewise_graphs.supports`)."""
        return self.use_cuda_graphs and self.verify_cuda_graphs

    @property
    def use_overlap_decode(self) -> bool:
        if self.overlap_decode is not None:
            return self.overlap_decode
        return self.resolved_device == "cuda" and self.tp == 1 and self.speculative is None


def canonical_mode(mode: str) -> str:
    """`mode` under its current name: an old name (`MODE_ALIASES`) is translated with a
    one-line deprecation warning; any other value is returned as given, for the caller's own
    validation to judge."""
    if mode in MODE_ALIASES:
        logger.warning(
            "mode=%r is deprecated: it is now named %r (the stock-PyTorch negative control)",
            mode, MODE_ALIASES[mode],
        )  # fmt: skip
        return MODE_ALIASES[mode]
    return mode


def _choice(name: str, value: object, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ConfigError(f"{name}={value!r} is invalid: expected one of {', '.join(accepted)}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer >= 1")
