"""The engine loop: requests in, one scheduled forward step at a time, outputs back.

Every entry point (the Python `LLM`, the CLI, the HTTP server, `lockstep check --serve`) runs
through this class. It is not thread-safe: exactly one thread calls it (the server runs it in
a process of its own, lockstep/server/engine_process.py).

    add_request -> Scheduler.waiting -> Scheduler.schedule() -> ModelRunner.launch()
                -> LaunchedStep (tokens and logprobs on their way to the host)
                -> prompt logprobs, appended tokens, text and stop handling -> StepOutput
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

import lockstep
from lockstep.cache import routed_experts as routed_store
from lockstep.cache.kv_pool import KVPool
from lockstep.cache.linear_snapshots import LinearSnapshotPool, SnapshotPolicy
from lockstep.cache.radix import RadixCache
from lockstep.config import EngineConfig
from lockstep.cpu_threads import set_engine_threads
from lockstep.engine import memory, piecewise_graphs
from lockstep.engine.cuda_graphs import (
    DecodeGraphRunner,
    graph_batch_buckets,
    graph_context_buckets,
)
from lockstep.engine.drafters import (
    TOKENIZER_PROBE,
    DraftModelDrafter,
    MtpDrafter,
    make_drafter,
)
from lockstep.engine.grammar import GrammarCompiler
from lockstep.engine.model_runner import ChunkLogits, LaunchedStep, ModelRunner, StepShape
from lockstep.engine.outputs import StepOutput, TokenLogprob
from lockstep.engine.request import Request, Status
from lockstep.engine.sampler import warm_up as warm_up_sampler
from lockstep.engine.sampling_params import SamplingParams
from lockstep.engine.scheduler import Scheduler
from lockstep.engine.speculative import Speculator
from lockstep.engine.step_budget import mixed_step_budget, ridge_flop_per_byte
from lockstep.engine.text_output import TextOutput
from lockstep.errors import ConfigError, ModelLoadError, RequestError, UnreadableWeights
from lockstep.models.decoder import Decoder
from lockstep.models.linear_attention import LinearState, LinearStatePool
from lockstep.models.mtp import MtpModel
from lockstep.models.resolver import resolve_model
from lockstep.models.spec import ModelSpec
from lockstep.ops import get_ops
from lockstep.ops.base import PooledLinearAttentionOps
from lockstep.parallel.group import ShardedDecoder, WorkerGroup
from lockstep.parallel.sharding import degree_problem, expert_problem, supported_degrees
from lockstep.parallel.worker import load_rank_decoder, set_threads

logger = logging.getLogger(__name__)
# Why FP8 models run at tp 1 on CUDA: a reduction chunk's partial must stay float32
# (lockstep/parallel/layers.py) and the GPU FP8 GEMM rounds its output to bf16.
FP8_CUDA_TP = (
    "FP8 models shard on the CPU only for now (the GPU FP8 GEMM has no float32-partial form)"
)


def _live(request: Request) -> bool:
    """Still running: not stopped, aborted or preempted since a step was launched for it."""
    return request.status is Status.RUNNING


class Engine:
    def __new__(cls, *args: Any, **kwargs: Any) -> Engine:  # noqa: ARG004
        # What is alive before the engine (torch, transformers, the caller's modules: some
        # 200k objects) is put out of the collector's reach: otherwise every full collection
        # walks it, 100-250 ms that stall a step every few hundred steps at batch 256
        # (docs/results.md). Done before the instance exists, so that the engine and everything
        # it makes stay collectable, cycles included.
        gc.collect()
        gc.freeze()
        return super().__new__(cls)

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        """`detokenize` False: outputs carry no text and stop strings end nothing; the caller
        makes the text from the token ids with `TextOutput`, as `_advance` does (the server's
        HTTP process, lockstep/server/output_text.py), and aborts a request its stop string
        ended."""
        self.config = config
        self.detokenize = detokenize
        self._thread_governor = set_engine_threads(config.num_threads, config.resolved_device)
        self.device = torch.device(config.resolved_device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            build = " (a CPU-only build)" if torch.version.cuda is None else ""
            raise ConfigError(
                f"device='cuda' is invalid: torch {torch.__version__}{build} sees no CUDA "
                "device; expected auto or cpu"
            )
        self.dtype = getattr(torch, config.resolved_dtype)
        self.kv_dtype = getattr(torch, config.resolved_kv_dtype)
        loaded = resolve_model(config.model, config.random_seed, config.revision)
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        spec = loaded.spec
        if config.max_model_len is not None and config.max_model_len > spec.max_position:
            raise ConfigError(
                f"max_model_len={config.max_model_len} is invalid for {loaded.name}: its "
                f"context is {spec.max_position} tokens; expected at most {spec.max_position}"
            )
        self.max_model_len = config.max_model_len or spec.max_position
        self.ops = get_ops(self.device.type, config.mode, config.mla_fused_input)
        head_dims = getattr(self.ops, "supported_head_dims", None)
        # MLA's latent attention has a kernel of its own (any widths the family accepts).
        if head_dims is not None and spec.mla is None and spec.head_dim not in head_dims:
            raise ModelLoadError(
                f"{loaded.source}: head_dim={spec.head_dim} is not supported by the "
                f"{self.ops.name} backend: supported head_dim values are {head_dims}"
            )
        problem = degree_problem(spec, config.tp)
        if problem is not None:
            raise ConfigError(
                f"tp={config.tp} is invalid for {loaded.name} ({spec.num_heads} heads,"
                f" {spec.num_kv_heads} KV heads): {problem}; degrees that work:"
                f" {', '.join(map(str, supported_degrees(spec)))}"
            )
        if spec.fp8 is not None and config.tp > 1 and self.device.type == "cuda":
            raise ConfigError(
                f"tp={config.tp} is invalid for {loaded.name} on CUDA: {FP8_CUDA_TP}; expected tp=1"
            )
        if (config.use_cuda_graphs and spec.moe is not None and spec.fp8 is None
                and config.resolved_tp_reduction == "chunked"):  # fmt: skip
            # At TP 1 the chunked reduction runs the sharded experts
            # (lockstep/parallel/experts.py), which read per-expert counts on the host.
            raise ConfigError(
                f"tp_reduction='chunked' is invalid with CUDA graphs for {loaded.name} at "
                "tp=1: its chunked experts read their slot counts on the host, which a graph "
                "cannot capture; expected --no-cuda-graphs, or tp_reduction 'ranks' (the TP 1 "
                "default)"
            )
        if spec.hybrid and config.tp > 1 and config.speculative is not None:
            # A verify step's rollback (LinearState.end_verify) rewrites rank 0's states only.
            raise ConfigError(
                f"speculative={config.speculative!r} is invalid for {loaded.name} at "
                f"tp={config.tp}: a hybrid model's verify steps roll back on one rank only; "
                "expected tp=1, or speculative off"
            )
        problem = expert_problem(spec, config.ep)
        if problem is not None:
            works = [ep for ep in supported_degrees(spec) if expert_problem(spec, ep) is None]
            raise ConfigError(
                f"ep={config.ep} is invalid for {loaded.name}: {problem}; expected ep=1"
                + (f" or ep={' or '.join(map(str, works[1:]))} (with --tp the same)"
                   if spec.moe is not None and len(works) > 1 else "")
            )  # fmt: skip
        if config.enable_return_routed_experts and spec.moe is None:
            raise ConfigError(
                f"enable_return_routed_experts=True is invalid for {loaded.name}: it has no "
                "routed experts; expected a mixture-of-experts model or the option off"
            )
        if self.device.type == "cuda" or config.tp > 1:  # what each rank will hold
            need = memory.RankWeights.of(spec, self.dtype.itemsize, config.tp, config.ep)
            where = "GPU" if self.device.type == "cuda" else "rank"
            logger.info("weights: at least %s", need.describe(where))
        if self.device.type == "cuda":  # refused with the arithmetic, before any load
            free, _ = torch.cuda.mem_get_info(self.device)
            memory.refuse_oversized_weights(loaded.name, spec, self.dtype.itemsize, config.tp,
                                            free, config.ep,
                                            FP8_CUDA_TP if spec.fp8 is not None else None)  # fmt: skip
        # Ranks 1..tp-1 start loading while rank 0 does (lockstep.parallel.group).
        self.workers: WorkerGroup | None = None
        if config.tp > 1:
            set_threads(config)
            self.workers = WorkerGroup(config)
        try:
            collectives = None if self.workers is None else self.workers.collectives
            local = load_rank_decoder(config, loaded, 0, self.max_model_len, collectives)
            if self.workers is not None:
                self.workers.wait_ready()
        except BaseException:
            self.close()
            raise
        self.decoder: Decoder | ShardedDecoder = (
            local if self.workers is None else ShardedDecoder(local, self.workers)
        )
        # Hybrid models: the running sequences' linear-attention states, allocated before the
        # KV pool is sized from what memory is left.
        layout = self.decoder.linear_layout
        self.state_pool = None
        if layout is not None:
            self.state_pool = LinearStatePool(layout, config.resolved_max_running)
        # Before the pool is sized: a draft model's engine takes its memory first.
        self.speculator = self._speculator()
        # Device memory allocated before the caches: the weights (and hybrid models' working
        # states): the base of `memory_bound`.
        self.allocated_before_pool = (
            torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        )
        # How the pool was sized from memory (lockstep/engine/memory.py); None: kv_tokens given.
        self.kv_budget = None if config.kv_tokens else self._kv_budget()
        kv_tokens = config.kv_tokens or self.kv_budget.kv_tokens
        _check_pool_holds_a_context(config, kv_tokens, self.max_model_len)
        if self.kv_budget is None and self.device.type == "cuda":  # given: refused if too big
            memory.refuse_oversized_pool(
                kv_tokens, self._bytes_per_token(), self._free_memory()[0], self._reservation(),
                self._snapshot_budget(None),
            )  # fmt: skip
        if self.kv_budget is not None:
            logger.info("%s", self.kv_budget.describe())
        # Hybrid models: the radix snapshots' own pool, its share taken out of the budget above.
        self.snapshot_pool: LinearSnapshotPool | None = None
        if layout is not None:
            budget = self.kv_budget.snapshots if self.kv_budget else self._snapshot_budget(None)
            assert budget is not None
            if self.kv_budget is None:  # sized by hand: at least refuse what cannot fit
                memory.refuse_oversized_snapshots(budget, *self._free_memory())
            self.snapshot_pool = LinearSnapshotPool(layout, budget.count)
            if self.kv_budget is None:
                logger.info("%s", budget.describe(self._bytes_per_token()))
        kv_heads = self.decoder.plan.num_local_kv_heads  # rank 0's; every rank holds as many
        # A hybrid model's CUDA graphs pad with rows that write one spare KV row.
        # (On a pooled backend only: a decode graph addresses linear states by pool slot.)
        pooled = isinstance(self.decoder.ops, PooledLinearAttentionOps)
        hybrid_graphs = config.use_cuda_graphs and self.state_pool is not None and pooled
        routing = None
        if config.enable_return_routed_experts:  # refused above for a model without experts
            assert spec.moe is not None
            routing = (
                *routed_store.store_row_shape(spec),
                routed_store.store_dtype(spec.moe.num_experts),
            )
        self.pool = KVPool(
            kv_tokens, len(spec.kv_layers), kv_heads, spec.cache_head_dim, self.kv_dtype,
            self.device, spare_slots=int(hybrid_graphs), values=spec.cache_values,
            routed_experts=routing,
        )  # fmt: skip
        if self.workers is not None:
            self.workers.send("kv_slots", kv_tokens)
        if isinstance(self.decoder, ShardedDecoder) and layout is not None:
            assert self.state_pool is not None and self.snapshot_pool is not None
            self.decoder.set_linear_pools(self.state_pool, self.snapshot_pool)
        self.radix = RadixCache(
            self.pool,
            enabled=config.enable_prefix_cache,
            state_aligned=layout is not None,
            snapshots=self.snapshot_pool,
        )
        resume, policy = None, None
        if layout is not None:
            resume = partial(LinearState.resume, layout, pool=self.state_pool, keep_all=False)
            if isinstance(self.decoder, ShardedDecoder):  # every rank fills the same slot
                resume = self.decoder.resume_linear_state
            policy = SnapshotPolicy(layout.chunk, config.linear_snapshot_interval)
        self.scheduler = Scheduler(
            self.pool,
            self.radix,
            max_batch_tokens=config.resolved_max_batch_tokens,
            chunk_size=config.resolved_chunk_size,
            max_running=config.resolved_max_running,
            new_linear_state=resume,
            snapshot_policy=policy,
            output_reserve=config.output_reserve,
            prompt_logprob_rows=memory.PROMPT_LOGPROB_ROWS,
            mixed_step=mixed_step_budget(
                spec,
                spec.num_parameters * (1 if spec.fp8 is not None else self.dtype.itemsize),
                self._bytes_per_token(routing=False),  # what a step reads: K/V
                self._mixed_step_cost(),
                ridge_flop_per_byte(_device_name(self.device)),
            ),
            speculator=self.speculator,
        )
        graphs = None
        keep_hidden = isinstance(self.speculator and self.speculator.drafter, MtpDrafter)
        if config.use_cuda_graphs and keep_hidden:
            # The MTP layer drafts from the target's hidden rows, which the graphs do not give.
            logger.warning("CUDA graphs are not used with speculative='mtp'")
        elif config.use_cuda_graphs and self.state_pool is not None and not hybrid_graphs:
            logger.warning("CUDA graphs are not used for hybrid models on the %s backend",
                           self.decoder.ops.name)  # fmt: skip
        elif config.use_cuda_graphs:
            graphs = DecodeGraphRunner(
                self.decoder, self.pool, max_batch=config.resolved_max_running,
                max_context=self.max_model_len, state_pool=self.state_pool,
                spare_kv_slot=self.pool.spare_slot, verify_graphs=self._runs_verify_graphs(),
            )  # fmt: skip
        piecewise = None
        if self._runs_piecewise():
            piecewise = piecewise_graphs.PiecewiseGraphRunner(
                self.decoder, self.pool, self._piecewise_tokens()
            )
        elif config.use_piecewise_cuda_graphs and not keep_hidden:
            logger.info("steps with prompt rows run eagerly (no piecewise CUDA graphs: %s)",
                        piecewise_graphs.supports(self.decoder))  # fmt: skip
        self.runner = ModelRunner(
            self.decoder, self.pool, graphs, piecewise, keep_hidden=keep_hidden
        )
        warm_up_sampler(self.device, spec.vocab_size)  # its kernels ready before any request
        # Structured outputs: llguidance's view of the tokenizer, built on first use.
        self.grammars = GrammarCompiler(self.tokenizer, spec.vocab_size)
        self.requests: dict[str, Request] = {}
        self._inflight: LaunchedStep | None = None  # a step launched ahead (overlap_decode)
        self._last_layout: list[ChunkLogits] = []  # the last completed step's chunks
        self.steps_launched_ahead = 0
        self.num_steps = 0  # forward steps completed by `step()`
        # Seconds the last `step()` waited for its tokens to reach the host: what is left of a
        # step's wall time is the host's own work (benchmarks report both).
        self.last_token_wait_s = 0.0
        self._arrival = itertools.count()
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0
        self.weights_source = loaded.source
        self.weight_updates = 0
        self.weight_version = "default"  # SGLang's name for the weights being served
        logger.info(
            "engine ready: model=%s device=%s dtype=%s mode=%s kv_tokens=%d%s",
            self.model_name, self.device, config.resolved_dtype, config.mode, kv_tokens,
            "" if self.snapshot_pool is None else
            f" linear_snapshots={self.snapshot_pool.num_slots} (kept at prompt ends and every "
            f"{config.linear_snapshot_interval} tokens)",
        )  # fmt: skip

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        namespace: str | None = None,
        stream: bool = False,
    ) -> None:
        """Queue a request. Raises `RequestError` when it can never be served as given.
        `stream`: its caller reads the tokens as they come, so the scheduler bounds the steps
        that stall it (`max_mixed_step_cost`); outputs never depend on it."""
        if request_id in self.requests:
            raise RequestError(f"request_id={request_id!r} is already in use")
        if params.n != 1:
            raise RequestError(f"n={params.n} is invalid here: the engine serves one sequence "
                               "per request (fan out n requests with seeds seed+i)")  # fmt: skip
        if params.return_routed_experts:
            self._refuse_unkept_routing()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(ids, params)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = Request(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            seed=seed,
            arrival=next(self._arrival),
            namespace=namespace,
            streams=stream,
        )
        if self.detokenize:
            request.text_output = TextOutput(self.tokenizer, ids, params)
        if params.processes_logits:
            self._prepare_processing(request)
        if params.prompt_logprobs is not None:
            first = max(1, params.prompt_logprobs_start)  # position 0 never has one
            request.prompt_logprobs = [None] * min(first, len(ids))
            request.prompt_logprobs_next = first
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _refuse_unkept_routing(self) -> None:
        """A request for routed experts the engine does not keep is a `RequestError`."""
        if self.decoder.spec.moe is None:
            raise RequestError(
                f"return_routed_experts=true is invalid for {self.model_name}: it is not a "
                "mixture-of-experts model (it has no routed experts)"
            )
        if self.pool.routed_experts is None:
            raise RequestError(
                "return_routed_experts=true needs the engine to keep routed experts: start it "
                "with --enable-return-routed-experts (enable_return_routed_experts=True)"
            )

    def routed_experts(self, request: Request) -> np.ndarray:
        """The experts each position of `request` that ran a forward went to, read from the
        routing store at its slots (lockstep/cache/routed_experts.py): int32
        [min(len(all_ids) - 1, computed), num_hidden_layers, top_k]. Call before its slots
        are released."""
        store = self.pool.routed_experts
        assert store is not None
        n = min(len(request.all_ids) - 1, request.num_computed)
        slots = torch.tensor(request.slots.ids[:n], dtype=torch.int64, device=store.device)
        return routed_store.sglang_layout(self.decoder.spec, store.index_select(0, slots))

    def _speculator(self) -> Speculator | None:
        """The speculative decoding the config asks for (docs/speculative.md), or None."""
        config = self.config
        if config.speculative is None:
            return None
        if config.speculative == "draft":
            return Speculator(DraftModelDrafter(self._draft_engine()), config.num_draft_tokens)
        if config.speculative == "mtp":
            return Speculator(MtpDrafter(self._mtp_model()), config.num_draft_tokens)
        drafter = make_drafter(
            config.speculative, config.prompt_lookup_min, config.prompt_lookup_max
        )
        return Speculator(drafter, config.num_draft_tokens)

    def _mtp_model(self) -> MtpModel:
        """The model's own multi-token-prediction layer, beside the target's weights (same
        backend, dtype and device; EngineConfig refuses it at tp > 1). Refused for a model
        without MTP weights (`ModelLoadError` says why)."""
        decoder = self.decoder
        assert isinstance(decoder, Decoder)
        try:
            return MtpModel.load(self.loaded, decoder.ops, decoder.dtype, decoder.device)
        except ModelLoadError as exc:
            raise ConfigError(
                f"speculative='mtp' is invalid for {self.model_name}: {exc}"
            ) from None

    def _draft_engine(self) -> Engine:
        """The engine of `draft_model`, on this engine's device: greedy, one request at a
        time, a pool of two contexts (its prefix cache keeps each sequence's KV between
        proposals). Refused unless it tokenizes as this model does."""
        config = self.config
        assert config.draft_model is not None
        draft_config = EngineConfig(
            model=config.draft_model, mode=config.mode, device=config.resolved_device,
            dtype=config.dtype, kv_tokens=2 * self.max_model_len, max_running=1,
            cuda_graphs=config.cuda_graphs, num_threads=config.num_threads,
            random_seed=config.random_seed, debug_checks=config.debug_checks,
        )  # fmt: skip
        draft = Engine(draft_config, detokenize=False)
        ours = self.tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
        theirs = draft.tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
        vocab, draft_vocab = self.loaded.spec.vocab_size, draft.decoder.spec.vocab_size
        if ours != theirs or draft_vocab > vocab:
            raise ConfigError(
                f"draft_model={config.draft_model!r} is invalid for {self.model_name}: its "
                f"tokenizer differs (vocabulary {draft_vocab} against {vocab}, or other ids "
                "for the same text); expected a model of the same tokenizer"
            )
        return draft

    def _prepare_processing(self, request: Request) -> None:
        """What logits processing reads besides the parameters: the grammar's matcher, the
        bad words' token ids (each word alone and after a space, as vLLM tokenizes them), the
        stop ids min_tokens masks and the prompt's distinct tokens."""
        params, vocab = request.params, self.decoder.spec.vocab_size
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is out of range: expected 0.."
                               f"{vocab - 1}")  # fmt: skip
        if params.structured_output is not None:
            request.grammar = self.grammars.state(params.structured_output)
        words: list[list[int]] = []
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        request.bad_word_ids = words
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.tokenizer.eos_token_ids
        request.stop_ids = frozenset(t for t in stop if t < vocab)
        if params.repetition_penalty != 1.0:
            request.prompt_token_set = sorted(set(request.prompt_ids))

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("prompt is empty: expected at least one token")
        vocab = self.decoder.spec.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is out of range: expected 0..{vocab - 1}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens and max_tokens={params.max_tokens}: together they "
                f"exceed the context limit max_model_len={self.max_model_len}"
            )
        need = len(ids) + params.max_tokens - 1
        if need > self.pool.num_slots:
            raise RequestError(
                f"the request needs up to {need} KV slots but the KV pool holds "
                f"{self.pool.num_slots}: it could never run (raise kv_tokens)"
            )

    def abort_request(self, request_id: str) -> StepOutput | None:
        """Stop a request and free its own KV slots at once; it yields no further output from
        `step`. Returns its closing output (no new token, the text still held back, finish
        reason "abort"), or None when no such request is unfinished."""
        request = self.requests.pop(request_id, None)
        routed = None
        if request is not None:
            if request.params.return_routed_experts:  # read before its slots are released
                routed = self.routed_experts(request)
            self.scheduler.abort(request)
        self._drop_dead_inflight()
        if request is None:
            return None
        text = request.text_output
        return StepOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="" if text is None else text.push(None, final=True).text,
            new_logprobs=[] if request.params.logprobs is not None else None,
            finished=True,
            finish_reason="abort",
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=max(request.cached_tokens, 0),
            completion_tokens=len(request.output_ids),
            seed=request.seed,
            prompt_logprobs=None if request.prompt_logprobs_sent else request.prompt_logprobs,
            routed_experts=routed,
        )

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- pausing (RL)
    def complete_launched_step(self) -> list[StepOutput]:
        """Complete the step launched ahead (overlapped decode), if any, and return its
        outputs: afterwards nothing runs on the device and no request has a pending token.
        A paused server calls this before it stops stepping (lockstep/server/rl_api.py)."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return []
        outputs = self._complete(launched)
        self._last_layout = launched.layout
        return outputs

    def retract_running(self) -> int:
        """Send every running request back to the waiting queue, as preemption does: its
        computed KV goes to the radix cache and is recomputed (or matched) when it is admitted
        again, which by position invariance gives the same bits. Call after
        `complete_launched_step`. Returns how many requests were retracted."""
        assert self._inflight is None, "retract_running with a step launched ahead"
        return self.scheduler.retract_all()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[StepOutput]:
        """Run one scheduled forward step and return its outputs.

        With `overlap_decode`, when the next step is sure to be a pure decode of the same
        requests (nothing admissible waiting, every running request sampled this step, free
        slots for all, not every one of them ending on max_tokens), it is scheduled and launched BEFORE this
        step's tokens are brought to the host: its pending rows take their tokens from this
        step's token tensor on the device. The host then handles this step's outputs while the
        device computes the next. Outputs are the same: each request computes the same
        positions from the same tokens, and a request that stops here computed one position
        more, which its release discards (or caches: the KV of a real token). That holds for a
        request this step ends on max_tokens too: its extra position, P + max_tokens - 1, is
        below max_model_len, and its slot is among the free ones counted."""
        if self._thread_governor is not None:
            self._thread_governor.tick()
        launched = self._inflight or self._launch(None)
        self._inflight = None
        if launched is not None:
            self.num_steps += 1
        if launched is None:
            self._last_layout = []
            return []
        # Speculation turns overlapped decode off (EngineConfig.use_overlap_decode): a draft
        # needs the tokens before it on the host.
        if self.config.use_overlap_decode and self._can_launch_ahead(launched):
            self._inflight = self._launch(launched, defer_processing=True)
            self.steps_launched_ahead += 1
        outputs = self._complete(launched)
        self._last_layout = launched.layout
        self._drop_dead_inflight()
        if self._inflight is not None and self._inflight.deferred is not None:
            # Logits processing reads this step's tokens: its choice is made now, while the
            # device still runs the forward launched ahead.
            self.runner.sample(self._inflight)
        if self.config.debug_checks:
            self.scheduler.check_integrity()
        return outputs

    def last_step_shape(self) -> StepShape:
        """What the step completed by the last `step()` computed: its prefill rows and its
        decode rows (for benchmarks; empty before the first step)."""
        return StepShape.of(self._last_layout)

    def _drop_dead_inflight(self) -> None:
        """Forget a step launched ahead once every request in it stopped or was aborted
        (its device work completes unread; their slots were already released)."""
        inflight = self._inflight
        if inflight is not None and not any(_live(p.chunk.request) for p in inflight.layout):
            self._inflight = None

    def _launch(
        self, after: LaunchedStep | None, defer_processing: bool = False
    ) -> LaunchedStep | None:
        """Schedule the next step and launch it on the device; each request that samples in
        it gets a pending token. `after`: the step launched before, whose tokens are this
        one's pending rows (a step launched ahead: it never preempts, and it admits only
        where prompts may be launched ahead, `_launches_prompts_ahead`); `defer_processing`:
        see ModelRunner.launch."""
        ahead = after is not None
        plan = self.scheduler.schedule(
            admit=not ahead or self._launches_prompts_ahead, may_preempt=not ahead
        )
        if not plan:
            if self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests waiting")
            return None
        launched = self.runner.launch(plan, after, defer_processing)
        for request, _ in launched.sampling:
            request.pending += 1
        return launched

    @property
    def _launches_prompts_ahead(self) -> bool:
        """Whether steps launched ahead may carry prompt chunks and admit (every model but
        the hybrid ones, whose linear states move with their prompt chunks; those launch
        only pure decode steps ahead)."""
        return self.decoder.linear_layout is None

    def _can_launch_ahead(self, launched: LaunchedStep) -> bool:
        """Whether the next step can be scheduled and launched before `launched`'s results
        reach the host: every running request that sampled in `launched` has that one token
        pending and all else computed (its next row takes the token from the device), every
        other one has nothing pending (a prompt still to compute, or a decode the budget left
        out), and completing `launched` needs no read from the device beyond its tokens
        (prompt or top logprobs would wait for the step launched ahead as well). Hybrid
        models: the next schedule must be one new token for exactly the running requests, all
        of which sampled in `launched`, and nothing admissible waits. A step launched ahead
        never preempts (`Scheduler.schedule(may_preempt=False)`); it may admit waiting
        requests, whose prefix match then misses what `launched` caches (speed only)."""
        scheduler = self.scheduler
        running = scheduler.running
        if not running or len(running) > scheduler.max_batch_tokens:
            return False
        prompts = self._launches_prompts_ahead
        if not prompts and (scheduler.would_admit() or launched.tokens is None):
            return False  # the next schedule would admit, or has no token to decode
        if launched.sampling and launched.tokens is None:
            return False  # its choice waits for the host (logits processing)
        decoding = sum(1 for r in running if r.num_computed >= len(r.prompt_ids))
        if scheduler.pool.num_free < decoding:
            return False
        if any(part.prompt_positions for part in launched.layout):
            return False
        if all(
            r.num_computed >= len(r.prompt_ids) and len(r.output_ids) + 1 >= r.params.max_tokens
            for r in running
        ):
            return False  # the step would compute nothing anyone reads
        sampled = {id(r) for r, _ in launched.sampling}
        for r in running:
            if id(r) in sampled:
                if r.pending != 1 or r.num_computed != r.num_tokens - 1 or r.params.logprobs:
                    return False
            elif not prompts or r.pending != 0:
                return False
        return True

    def _complete(self, launched: LaunchedStep) -> list[StepOutput]:
        """Apply a launched step's results on the host: prompt logprobs, appended tokens,
        finish conditions, text. Requests that stopped or were aborted while it ran are
        skipped."""
        for part in launched.layout:
            request = part.chunk.request
            if part.prompt_positions and _live(request):
                assert request.prompt_logprobs is not None
                k = request.params.prompt_logprobs or 0
                request.prompt_logprobs.extend(launched.prompt_logprobs(part, k))
                request.prompt_logprobs_next = part.prompt_positions[-1] + 2
        outputs: list[StepOutput] = []
        waited = time.perf_counter()
        tokens, chosen_lps = launched.chosen()
        self.last_token_wait_s = time.perf_counter() - waited
        drafts = {id(p.chunk.request): p.chunk.draft for p in launched.layout if p.chunk.draft}
        runs = self.speculator.start_verify(drafts) if drafts and self.speculator else None
        for (request, row), token, lp in zip(launched.sampling, tokens, chosen_lps, strict=True):
            request.pending -= 1
            if not _live(request) or (runs is not None and not runs.keeps(request)):
                continue
            top = launched.top_logprobs(row, request.params.logprobs or 0)
            outputs.append(self._advance(request, TokenLogprob(token, lp, top)))
            if launched.hidden is not None:  # MTP drafting: the row that chose this token
                request.last_hidden = launched.hidden[row].clone()
                request.last_hidden_at = request.num_tokens
            if runs is not None:
                runs.kept(request, outputs[-1].finished)
        # Before anything caches a prefix: rejected drafts' slots go back to the pool.
        for part in launched.layout:
            if part.chunk.draft and _live(part.chunk.request):
                self.scheduler.discard_unverified(part.chunk.request)
        # After the tokens are appended: caching the prompt reads all_ids.
        for part in launched.layout:
            if part.chunk.completes_prompt and _live(part.chunk.request):
                self._on_prefill_done(part.chunk.request)
        for out in outputs:
            if out.finished:
                request = self.requests.pop(out.request_id)
                if request.params.return_routed_experts:
                    out.routed_experts = self.routed_experts(request)
                self.scheduler.finish(request)
        return outputs

    def _on_prefill_done(self, request: Request) -> None:
        if not request.prompt_counted:  # once, even when preemption recomputes the prompt
            request.prompt_counted = True
            self.prompt_tokens_total += len(request.prompt_ids)
            self.cached_tokens_total += max(request.cached_tokens, 0)
        # Share the prompt's KV with requests that arrive while this one still decodes.
        self.scheduler.cache_prefix(request)

    def _advance(self, request: Request, chosen: TokenLogprob) -> StepOutput:
        """Append the chosen token to the request: logprobs, finish conditions, text."""
        params = request.params
        token = chosen.token_id
        request.output_ids.append(token)
        request.output_logprobs.append(chosen)
        self.generated_tokens_total += 1
        if request.grammar is not None:
            request.grammar.accept(token)
        finish, stop_reason = self._finish_reason(request, token)
        # The text of an EOS or stop token is not part of the output (as in vLLM); the token
        # that completes a structured output is.
        hidden = finish == "stop" and not (request.grammar and request.grammar.finished_on_text)
        new_text = ""
        if request.text_output is not None:
            text = request.text_output.push(
                None if hidden else token,
                final=finish is not None,
                check_stops=len(request.output_ids) >= params.min_tokens,
            )
            new_text = text.text
            if text.stop_string is not None:
                finish, stop_reason = "stop", text.stop_string
        out = StepOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            new_text=new_text,
            new_logprobs=[chosen] if params.logprobs is not None else None,
            finished=finish is not None,
            finish_reason=finish,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=max(request.cached_tokens, 0),
            completion_tokens=len(request.output_ids),
            seed=request.seed,
            stop_reason=stop_reason,
            new_token_logprobs=[chosen.logprob],
            hides_token=hidden,
        )
        if not request.prompt_logprobs_sent:
            out.prompt_logprobs = request.prompt_logprobs
            request.prompt_logprobs_sent = True
        return out

    def _finish_reason(self, request: Request, token: int) -> tuple[str | None, int | None]:
        params = request.params
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            return "stop", None
        if len(request.output_ids) >= params.max_tokens:
            return "length", None
        if request.grammar is not None and request.grammar.finished:
            return "stop", None  # the structured output is complete
        return None, None

    # ----------------------------------------------------------------- weights
    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        source: str = "in-process",
        version: str | None = None,
    ) -> None:
        """Swap in new weights of the same architecture, in place, between steps: canonical
        (name, tensor) pairs or a state dict (spec.py names). Refused with `RequestError`
        while requests run (their KV is the old model's); waiting ones (retracted by a pause,
        or not yet admitted) compute everything with the new weights. A bad set of tensors is a
        `ModelLoadError` and leaves the old weights serving. The prefix cache is flushed:
        its KV was computed by the old weights. The same weights give the same bits as
        before (loading is a copy, the kernels are unchanged)."""
        running = len(self.scheduler.running)
        if running or self._inflight is not None:
            raise RequestError(
                f"{running} request(s) are running: finish, abort or retract them"
                " (/pause_generation) before updating the weights"
            )
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        self.decoder.update_weights(pairs, source)
        self._inflight = None
        self.radix.flush()
        self.weights_source = source
        self.weight_updates += 1
        self.weight_version = version if version is not None else str(self.weight_updates)
        logger.info("weights updated from %s (version %s)", source, self.weight_version)

    def update_weights_from_disk(self, model: str, version: str | None = None) -> None:
        """`update_weights` from a checkpoint (a Hugging Face folder, a .gguf file or a
        random preset) whose architecture equals the served one; a different architecture is
        a `ModelLoadError` naming the first field that differs. The tokenizer stays."""
        try:
            loaded = resolve_model(model, random_seed=self.config.random_seed)
        except ModelLoadError as exc:
            raise UnreadableWeights(str(exc)) from None
        mismatch = _spec_mismatch(self.decoder.spec, loaded.spec)
        if mismatch:
            raise ModelLoadError(
                f"{loaded.source}: not the served architecture ({mismatch}); a weight update"
                " needs a checkpoint of the same shape"
            )
        # Produced on the engine's device, as at load (a random preset's values depend on the
        # device that draws them), and moved to the host one tensor at a time.
        self.update_weights(loaded.iter_weights(self.dtype, self.device), loaded.source, version)

    # ----------------------------------------------------------------- cache and status
    def flush_cache(self) -> int:
        """Evict every cached prefix no running request holds; returns the tokens freed."""
        return self.radix.flush()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def memory_bound(self) -> dict[str, Any] | None:
        """What this engine's device memory may reach (CUDA; None on the CPU): what was
        allocated before the caches, the KV pool, the snapshot pool and the reservation
        (lockstep/engine/memory.py), in bytes, with their sum as `bound`."""
        if self.device.type != "cuda":
            return None
        pool = self.pool.num_slots * self._bytes_per_token()
        snapshots = 0
        if self.snapshot_pool is not None:
            assert self.decoder.linear_layout is not None
            snapshots = self.snapshot_pool.num_slots * self.decoder.linear_layout.snapshot_bytes
        reserved = self._reservation().total
        base = self.allocated_before_pool
        return {"before_pool": base, "kv_pool": pool, "snapshots": snapshots,
                "reserved": reserved, "bound": base + pool + snapshots + reserved}  # fmt: skip

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_total": self.pool.num_slots,
            "kv_free": self.pool.num_free,
            "kv_cached": self.radix.num_cached_tokens,
            "kv_in_use": self.scheduler.in_use,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "generated_tokens_total": self.generated_tokens_total,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "steps_launched_ahead": self.steps_launched_ahead,
            "state_snapshots": self.radix.num_states,
            "state_bytes": self.radix.state_bytes,
            "state_snapshot_slots": self.snapshot_pool.num_slots if self.snapshot_pool else 0,
            "state_snapshots_free": self.snapshot_pool.num_free if self.snapshot_pool else 0,
            "state_snapshots_not_kept": self.scheduler.snapshots_not_kept,
            "state_snapshots_evicted": self.radix.num_evicted_states,
            **self._speculation_stats(),
        }

    def _speculation_stats(self) -> dict[str, Any]:
        """Speculative decoding's counters since start (zeros without speculation)."""
        counters = self.speculator.counters if self.speculator is not None else None
        return {
            "spec_drafted_tokens_total": counters.drafted if counters else 0,
            "spec_accepted_tokens_total": counters.accepted if counters else 0,
            "spec_verify_chunks_total": counters.verify_chunks if counters else 0,
            "spec_acceptance_rate": counters.acceptance_rate if counters else 0.0,
            "spec_boundary_limited_total": counters.boundary_limited if counters else 0,
        }

    # ----------------------------------------------------------------- tensor parallelism
    @property
    def failure(self) -> str | None:
        """Why the engine cannot compute another step (a tensor-parallel worker is gone), or
        None while it can."""
        return None if self.workers is None else self.workers.failure

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(message)` once the engine cannot go on (a worker died); never at
        tp=1."""
        if self.workers is not None:
            self.workers.on_failure(callback)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at tp=1). Idempotent; the engine
        computes nothing afterwards."""
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.close()

    def fingerprint(self) -> dict[str, Any]:
        """What the results depend on (docs/design.md, "The contract")."""
        return {
            "engine_version": lockstep.__version__,
            "ops_backend": self.ops.name,
            "mode": self.config.mode,
            "tp_reduction": self.config.resolved_tp_reduction,
            "dtype": self.config.resolved_dtype,
            "kv_dtype": self.config.resolved_kv_dtype,
            "device": self.device.type,
            "device_name": _device_name(self.device),
            "model": self.model_name,
            "model_source": self.loaded.source,
            "weights_source": self.weights_source,
            "weight_version": self.weight_version,
        }

    def _free_memory(self) -> tuple[int, str]:
        """The device memory free now (the available RAM on the CPU), and what it is."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks cached while loading the weights are free memory
            return torch.cuda.mem_get_info(self.device)[0], "the free device memory"
        return memory.available_ram(), "the available RAM"

    def _bytes_per_token(self, routing: bool = True) -> int:
        """What one pool slot costs: its K/V, and its routed experts when the engine keeps
        them (`routing`; lockstep/cache/routed_experts.py)."""
        routed = routing and self.config.enable_return_routed_experts
        return memory.bytes_per_token(self.decoder.spec, self.decoder.plan.num_local_kv_heads,
                                      self.kv_dtype, routed)  # fmt: skip

    def _snapshot_budget(self, cache_bytes: int | None) -> memory.SnapshotBudget | None:
        """A hybrid model's snapshot pool (None for other models): `linear_snapshots`, else
        the default from `max_running` and the caches' share `cache_bytes` (None: kv_tokens
        given); none without a prefix cache."""
        layout, config = self.decoder.linear_layout, self.config
        if layout is None:
            return None
        count = config.linear_snapshots
        if not config.enable_prefix_cache:
            count = 0
        elif count is None:
            count = memory.default_linear_snapshots(
                config.resolved_max_running, layout.snapshot_bytes, cache_bytes
            )
        return memory.SnapshotBudget(count, layout.snapshot_bytes)

    def _reservation(self) -> memory.StepWorkspace:
        """What the largest step and the CUDA graphs may allocate beside the pool (CUDA)."""
        config = self.config
        max_running = config.resolved_max_running
        buckets = None
        if config.use_cuda_graphs:
            buckets = (graph_batch_buckets(max_running), graph_context_buckets(self.max_model_len))
        piecewise = self._piecewise_tokens() if self._runs_piecewise() else 0
        return memory.step_workspace(
            self.decoder.spec, self.decoder.act_dtype.itemsize, config.resolved_max_batch_tokens,
            max_running, buckets, piecewise_tokens=piecewise,
        )  # fmt: skip

    def _runs_piecewise(self) -> bool:
        """Whether steps with prompt rows replay piecewise CUDA graphs (not with MTP drafting,
        which needs the hidden rows the graphs do not give)."""
        config = self.config
        return (
            config.use_piecewise_cuda_graphs
            and config.speculative != "mtp"
            and piecewise_graphs.supports(self.decoder) is None
        )

    def _runs_verify_graphs(self) -> bool:
        """Whether verify steps of equal rows per sequence replay whole-step graphs: asked
        for, speculating, and a model whose mixers are all paged attention (no linear state
        to cut back, the attention whose chunk path a graph fixes)."""
        return (
            self.config.use_verify_cuda_graphs
            and self.speculator is not None
            and self.state_pool is None
            and piecewise_graphs.supports(self.decoder) is None
        )

    def _mixed_step_cost(self) -> float:
        """The mixed-step bound: the one asked for, else the device's default where steps
        with prompt rows replay piecewise graphs, else none (an eager mixed step pays the
        host's launch work, which cutting prompts finer only multiplies:
        lockstep/engine/step_budget.py)."""
        config = self.config
        if config.max_mixed_step_cost is None and not self._runs_piecewise():
            return 0.0
        return config.resolved_max_mixed_step_cost

    def _piecewise_tokens(self) -> int:
        """The largest step the piecewise graphs take."""
        return min(piecewise_graphs.MAX_TOKENS, self.config.resolved_max_batch_tokens)

    def _kv_budget(self) -> memory.KVBudget:
        """Size the KV pool from memory (lockstep/engine/memory.py): on CUDA what is free after
        the weights less the largest step's workspace and the CUDA graphs, on the CPU a share
        of the available RAM; a hybrid model's snapshot pool comes out of it first."""
        config = self.config
        per_token = self._bytes_per_token()
        fraction = config.resolved_kv_memory_fraction
        if self.device.type != "cuda":
            available = memory.available_ram()
            snapshots = self._snapshot_budget(int(available * fraction))
            return memory.cpu_kv_budget(available, per_token, fraction, snapshots)
        reserved = self._reservation()
        free, _ = self._free_memory()
        snapshots = self._snapshot_budget(memory.cuda_cache_bytes(free, reserved, fraction))
        return memory.cuda_kv_budget(free, per_token, reserved, fraction, snapshots)


# The interpreter's last collection at exit reclaims what the engines froze (extension modules
# that count their live objects at exit, Triton's among them, would otherwise report leaks).
atexit.register(gc.unfreeze)


def _spec_mismatch(served: ModelSpec, new: ModelSpec) -> str | None:
    """The first architecture field in which `new` differs from `served` (the context length
    a checkpoint declares may differ: the served limit stays)."""
    for f in dataclasses.fields(served):
        if f.name != "max_position" and getattr(served, f.name) != getattr(new, f.name):
            return f"{f.name}={getattr(new, f.name)!r}, served {getattr(served, f.name)!r}"
    return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


__all__ = ["Engine"]


def _check_pool_holds_a_context(config: EngineConfig, kv_tokens: int, max_model_len: int) -> None:
    """A pool smaller than one full context refuses every longer request. Both sizes given:
    a contradiction, refused. Only the pool given, as benchmarks and tests do: said at start
    when the pool cannot hold even one prefill chunk (`--kv-tokens 10`), so that the
    refusals that follow are no surprise."""
    if kv_tokens >= max_model_len:
        return
    if config.max_model_len is not None:
        raise ConfigError(
            f"kv_tokens={kv_tokens} is invalid with max_model_len={max_model_len}: the KV pool "
            f"must hold one whole context; expected kv_tokens >= {max_model_len} or a smaller "
            "max_model_len"
        )
    chunk = min(config.resolved_chunk_size, max_model_len)
    if kv_tokens < chunk:
        logger.warning(
            "kv_tokens=%d is less than one prefill chunk (%d tokens) and than the model's "
            "context (%d): a request whose prompt and output need more than %d tokens is "
            "refused",
            kv_tokens, chunk, max_model_len, kv_tokens,
        )  # fmt: skip
