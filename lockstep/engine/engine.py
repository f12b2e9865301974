"""The engine loop: requests in, one scheduled forward step at a time, outputs back.

Every entry point (the Python `LLM`, the CLI, the HTTP server, `lockstep check --serve`) runs
through this class. It is not thread-safe: exactly one thread calls it (the server runs it in
a dedicated loop thread).

    add_request -> Scheduler.waiting -> schedule() -> ModelRunner.run() -> log_softmax
                -> prompt logprobs / sampling -> text and stop handling -> StepOutput
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import lockstep
from lockstep.cache.kv_pool import KVPool
from lockstep.cache.radix import RadixCache
from lockstep.config import EngineConfig
from lockstep.engine.cuda_graphs import DecodeGraphRunner
from lockstep.engine.model_runner import ChunkLogits, ModelRunner, TokenSource
from lockstep.engine.outputs import StepOutput, TokenLogprob
from lockstep.engine.request import Request, Status
from lockstep.engine.sampler import RowSampling, choose_token_tensor, top_logprobs
from lockstep.engine.sampler import warm_up as warm_up_sampler
from lockstep.engine.sampling_params import SamplingParams
from lockstep.engine.scheduler import ScheduledChunk, Scheduler
from lockstep.engine.text_output import TextOutput
from lockstep.errors import ModelLoadError, RequestError
from lockstep.models.decoder import Decoder
from lockstep.models.resolver import resolve_model
from lockstep.ops import get_ops

logger = logging.getLogger(__name__)

# Without an explicit kv_tokens the CPU pool is capped: a CPU serves few long sequences, and a
# pool sized from RAM alone would zero gigabytes at start-up for nothing.
CPU_DEFAULT_KV_TOKEN_CAP = 65536


@dataclass
class _Launched:
    """A step enqueued on the device whose results the host has not read yet."""

    layout: list[ChunkLogits]
    prefill_done_before: list[bool]  # per layout part: prompt fully computed before the step
    logits: torch.Tensor
    logprobs: torch.Tensor
    sampling: list[tuple[Request, int]]  # requests that choose a token, and their logits row
    tokens: torch.Tensor | None = None  # chosen tokens (device), one per sampling entry
    # [2, n] float64 tokens and their logprobs, on the host once `ready` (a CUDA event)
    # has passed: copied asynchronously at launch, so that reading them never waits for a
    # step launched after this one.
    host_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


def _live(request: Request) -> bool:
    """Still running: not stopped, aborted or preempted since a step was launched for it."""
    return request.status is Status.RUNNING


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.resolved_device)
        self.dtype = getattr(torch, config.resolved_dtype)
        loaded = resolve_model(config.model, random_seed=config.random_seed)
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        spec = loaded.spec
        self.max_model_len = config.max_model_len or spec.max_position
        self.ops = get_ops(self.device.type, config.mode)
        head_dims = getattr(self.ops, "supported_head_dims", None)
        if head_dims is not None and spec.head_dim not in head_dims:
            raise ModelLoadError(
                f"{loaded.source}: head_dim={spec.head_dim} is not supported by the "
                f"{self.ops.name} backend: supported head_dim values are {head_dims}"
            )
        self.decoder = Decoder.load(loaded, self.ops, self.dtype, self.device, self.max_model_len)
        kv_tokens = config.kv_tokens or self._kv_tokens_from_memory()
        self.pool = KVPool(
            kv_tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype, self.device
        )
        self.radix = RadixCache(self.pool, enabled=config.enable_prefix_cache)
        self.scheduler = Scheduler(
            self.pool,
            self.radix,
            max_batch_tokens=config.max_batch_tokens,
            chunk_size=config.chunk_size,
            max_running=config.max_running,
        )
        graphs = None
        if config.use_cuda_graphs:
            graphs = DecodeGraphRunner(
                self.decoder, self.pool, max_batch=config.max_running,
                max_context=self.max_model_len,
            )  # fmt: skip
        self.runner = ModelRunner(self.decoder, self.pool, graphs)
        warm_up_sampler(self.device, spec.vocab_size)  # its kernels ready before any request
        self.requests: dict[str, Request] = {}
        self._inflight: _Launched | None = None  # a step launched ahead (overlap_decode)
        self.steps_launched_ahead = 0
        self._arrival = itertools.count()
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0
        logger.info(
            "engine ready: model=%s device=%s dtype=%s mode=%s kv_tokens=%d",
            self.model_name, self.device, config.resolved_dtype, config.mode, kv_tokens,
        )  # fmt: skip

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        namespace: str | None = None,
    ) -> None:
        """Queue a request. Raises `RequestError` when it can never be served as given."""
        if request_id in self.requests:
            raise RequestError(f"request_id={request_id!r} is already in use")
        if params.n != 1:
            raise RequestError(f"n={params.n} is invalid here: the engine serves one sequence "
                               "per request (fan out n requests with seeds seed+i)")  # fmt: skip
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
        )
        request.text_output = TextOutput(self.tokenizer, ids, params)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.requests[request_id] = request
        self.scheduler.add(request)

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

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its own KV slots at once; it yields no further output."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request)
        self._drop_dead_inflight()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[StepOutput]:
        """Run one scheduled forward step and return its outputs.

        With `overlap_decode`, when the next step is sure to be a pure decode of the same
        requests (nothing waiting, every running request sampled this step, none certain to
        stop on max_tokens, free slots for all), it is scheduled and launched BEFORE this
        step's tokens are brought to the host: its pending rows take their tokens from this
        step's token tensor on the device. The host then handles this step's outputs while the
        device computes the next. Outputs are the same: each request computes the same
        positions from the same tokens, and a request that stops here computed one position
        more, which its release discards (or caches: the KV of a real token)."""
        launched = self._inflight or self._launch_scheduled()
        self._inflight = None
        if launched is None:
            return []
        if self.config.use_overlap_decode and self._can_launch_ahead(launched):
            self._inflight = self._launch(self.scheduler.schedule(), self._token_source(launched))
            self.steps_launched_ahead += 1
        outputs = self._complete(launched)
        self._drop_dead_inflight()
        if self.config.debug_checks:
            self.scheduler.check_integrity()
        return outputs

    def _drop_dead_inflight(self) -> None:
        """Forget a step launched ahead once every request in it stopped or was aborted
        (its device work completes unread; their slots were already released)."""
        if self._inflight is not None and not any(_live(r) for r, _ in self._inflight.sampling):
            self._inflight = None

    def _launch_scheduled(self) -> _Launched | None:
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests waiting")
            return None
        return self._launch(plan, None)

    def _launch(self, plan: list[ScheduledChunk], source: TokenSource | None) -> _Launched:
        """Enqueue the forward, log-softmax and token choice of `plan` on the device, with no
        host wait (the eager CUDA path's patch indices aside: ModelRunner.run). Each sampling
        request gets a pending token."""
        logits, layout = self.runner.run(plan, source)
        logprobs = self.ops.log_softmax(logits)
        prefill_done_before: list[bool] = []
        sampling: list[tuple[Request, int]] = []
        for part in layout:
            request = part.chunk.request
            prefill_done_before.append(request.num_computed >= len(request.prompt_ids))
            request.num_computed = part.chunk.end
            if part.sample_row is not None:
                sampling.append((request, part.sample_row))
        launched = _Launched(layout, prefill_done_before, logits, logprobs, sampling)
        if sampling:
            choices = [
                RowSampling(
                    temperature=r.params.temperature, top_k=r.params.top_k,
                    top_p=r.params.top_p, min_p=r.params.min_p, seed=r.seed,
                    position=r.num_tokens,
                )
                for r, _ in sampling
            ]  # fmt: skip
            row_ids = [row for _, row in sampling]
            if row_ids == list(range(logits.shape[0])):  # decode steps: every row samples
                picked, picked_lps = logits, logprobs
            else:
                rows = torch.tensor(row_ids, dtype=torch.int64, device=logits.device)
                picked, picked_lps = logits.index_select(0, rows), logprobs.index_select(0, rows)
            launched.tokens = choose_token_tensor(picked, choices)
            chosen = picked_lps.gather(1, launched.tokens[:, None])[:, 0]
            # One transfer for tokens and their logprobs (float64 holds both exactly).
            both = torch.stack((launched.tokens.double(), chosen.double()))
            if both.device.type == "cuda":
                launched.host_tokens = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
                launched.host_tokens.copy_(both, non_blocking=True)
                launched.ready = torch.cuda.Event()
                launched.ready.record()
            else:
                launched.host_tokens = both
            for request, _ in sampling:
                request.pending += 1
        return launched

    def _can_launch_ahead(self, launched: _Launched) -> bool:
        """Whether the next schedule is certain to be one new token for exactly the running
        requests, all of which sampled in `launched` (no admission, eviction or preemption),
        and completing `launched` needs no read from the device beyond its tokens (prompt or
        top logprobs would wait for the step launched ahead as well)."""
        scheduler = self.scheduler
        running = scheduler.running
        if not running or len(running) > self.config.max_batch_tokens:
            return False
        if scheduler.waiting and len(running) < self.config.max_running:
            return False  # the next schedule would admit
        if launched.tokens is None or scheduler.pool.num_free < len(running):
            return False
        if any(part.prompt_positions for part in launched.layout):
            return False
        sampled = {id(r) for r, _ in launched.sampling}
        return all(
            id(r) in sampled
            and r.pending == 1
            and r.num_computed == r.num_tokens - 1
            and len(r.output_ids) + 1 < r.params.max_tokens
            and not r.params.logprobs
            for r in running
        )

    @staticmethod
    def _token_source(launched: _Launched) -> TokenSource:
        assert launched.tokens is not None
        return TokenSource(
            launched.tokens, {id(r): i for i, (r, _) in enumerate(launched.sampling)}
        )

    def _complete(self, launched: _Launched) -> list[StepOutput]:
        """Bring a launched step's tokens to the host (the step's one host sync on greedy
        decode) and apply them: prompt logprobs, appended tokens, finish conditions, text.
        Requests that stopped or were aborted while it ran are skipped."""
        for part in launched.layout:
            if part.prompt_positions and _live(part.chunk.request):
                self._record_prompt_logprobs(part.chunk.request, part.prompt_positions,
                                             part.prompt_rows, launched.logprobs)  # fmt: skip
        outputs: list[StepOutput] = []
        if launched.sampling:
            assert launched.host_tokens is not None
            if launched.ready is not None:
                launched.ready.synchronize()  # this step's copy only, not later steps
            tokens_f, chosen_lps = launched.host_tokens.tolist()
            for (request, row), token, lp in zip(launched.sampling, tokens_f, chosen_lps,
                                                 strict=True):  # fmt: skip
                request.pending -= 1
                if not _live(request):
                    continue
                top = top_logprobs(launched.logprobs[row], request.params.logprobs or 0)
                outputs.append(self._advance(request, TokenLogprob(int(token), lp, top)))
        # After the tokens are appended: with a step launched ahead, num_computed already
        # covers the position of the token just appended, and caching reads all_ids.
        for part, done_before in zip(launched.layout, launched.prefill_done_before, strict=True):
            request = part.chunk.request
            if (
                _live(request)
                and not done_before
                and request.num_computed >= len(request.prompt_ids)
            ):
                self._on_prefill_done(request)
        for out in outputs:
            if out.finished:
                request = self.requests.pop(out.request_id)
                self.scheduler.finish(request)
        return outputs

    def _on_prefill_done(self, request: Request) -> None:
        if not request.prompt_counted:  # once, even when preemption recomputes the prompt
            request.prompt_counted = True
            self.prompt_tokens_total += len(request.prompt_ids)
            self.cached_tokens_total += max(request.cached_tokens, 0)
        # Share the prompt's KV with requests that arrive while this one still decodes.
        self.scheduler.cache_prefix(request)

    def _record_prompt_logprobs(
        self, request: Request, positions: list[int], rows: list[int], logprobs: torch.Tensor
    ) -> None:
        """Logprobs of prompt[p + 1] from the logits at each position p: one gather and one
        host transfer for the chunk; top alternatives only when asked for."""
        k = request.params.prompt_logprobs or 0
        assert request.prompt_logprobs is not None
        device = logprobs.device
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        token_ids = [request.prompt_ids[p + 1] for p in positions]
        targets = torch.tensor(token_ids, dtype=torch.int64, device=device)
        chunk = logprobs.index_select(0, row_index)
        values = chunk.gather(1, targets[:, None])[:, 0].tolist()
        for i, (token, value) in enumerate(zip(token_ids, values, strict=True)):
            request.prompt_logprobs.append(TokenLogprob(token, value, top_logprobs(chunk[i], k)))
        request.prompt_logprobs_next = positions[-1] + 2

    def _advance(self, request: Request, chosen: TokenLogprob) -> StepOutput:
        """Append the chosen token to the request: logprobs, finish conditions, text."""
        params = request.params
        token = chosen.token_id
        request.output_ids.append(token)
        self.generated_tokens_total += 1
        finish, stop_reason = self._finish_reason(request, token)
        # The text of an EOS or stop token is not part of the output (as in vLLM).
        text = request.text_output.push(
            token if finish in (None, "length") else None, final=finish is not None
        )
        if text.stop_string is not None:
            finish, stop_reason = "stop", text.stop_string
        out = StepOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            new_text=text.text,
            new_logprobs=[chosen] if params.logprobs is not None else None,
            finished=finish is not None,
            finish_reason=finish,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=max(request.cached_tokens, 0),
            completion_tokens=len(request.output_ids),
            seed=request.seed,
            stop_reason=stop_reason,
            new_token_logprobs=[chosen.logprob],
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
        return None, None

    # ----------------------------------------------------------------- cache and status
    def flush_cache(self) -> int:
        """Evict every cached prefix no running request holds; returns the tokens freed."""
        return self.radix.flush()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

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
        }

    def fingerprint(self) -> dict[str, Any]:
        """What the results depend on (DESIGN.md, "What may change results")."""
        return {
            "engine_version": lockstep.__version__,
            "kernel_table_version": getattr(self.ops, "kernel_table_version", self.ops.name),
            "ops_backend": self.ops.name,
            "mode": self.config.mode,
            "dtype": self.config.resolved_dtype,
            "device": self.device.type,
            "device_name": _device_name(self.device),
            "model": self.model_name,
            "model_source": self.loaded.source,
        }

    def _kv_tokens_from_memory(self) -> int:
        spec = self.decoder.spec
        per_token = KVPool.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                           self.dtype)  # fmt: skip
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * self.config.kv_memory_fraction) // per_token)
        available = _available_ram()
        tokens = int(available * self.config.kv_memory_fraction) // per_token
        return max(1, min(tokens, CPU_DEFAULT_KV_TOKEN_CAP))


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


__all__ = ["Engine"]
