"""The device side of a step: a scheduler plan in, a launched step out.

`ModelRunner.launch` lays out the plan's rows (tokens, absolute positions, output slots), the
chunks' slot tables for attention and which rows need logits:
  * the last row, when the chunk reaches the end of the request's tokens (it samples);
  * rows whose logits give a still-owed prompt logprob (position p predicts prompt[p+1]);
then enqueues the forward (eagerly, or from a CUDA graph for pure decode steps), the
log-softmax, the logits processing of requests that ask for it (penalties, biases, grammars:
lockstep/engine/logits_processing.py, always eager) and the token choice, and starts copying the chosen tokens and their logprobs to
the host. It returns a `LaunchedStep` without waiting for the device; the engine reads the
step's results through it, on the host side only.

A row whose token is still pending (chosen on the device by the step launched before, not yet
on the host: overlapped decode) is built with a placeholder and patched on the device from
that step's token tensor before the forward runs, so building never waits for it.

    Engine.step:  Scheduler.schedule() -> ModelRunner.launch(plan, after) -> LaunchedStep
                  -> LaunchedStep.chosen() (one host sync) -> Engine applies tokens, text
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lockstep.engine.cuda_graphs import DecodeGraphRunner
from lockstep.engine.logits_processing import process_logits
from lockstep.engine.outputs import TokenLogprob
from lockstep.engine.piecewise_graphs import PiecewiseGraphRunner
from lockstep.engine.request import Request
from lockstep.engine.sampler import RowSampling, choose_token_tensor, top_logprobs
from lockstep.engine.scheduler import ScheduledChunk
from lockstep.models.decoder import Decoder, KVStorage
from lockstep.models.forward_batch import ForwardBatch
from lockstep.ops.base import build_attention_meta


@dataclass(frozen=True)
class TokenSource:
    """Where pending tokens come from: a launched step's chosen tokens (device, int64) and
    each pending request's index into them (keyed by id(request))."""

    tokens: torch.Tensor
    index: dict[int, int]


@dataclass(frozen=True)
class ChunkLogits:
    """Which logits rows (indices into the step's logits) belong to one chunk."""

    chunk: ScheduledChunk
    prompt_positions: list[int]  # positions p whose logits score prompt[p + 1]
    prompt_rows: list[int]
    sample_row: int | None
    # A verify chunk's draft positions, in order: row i chooses the token after draft[i]
    # (lockstep/engine/speculative.py).
    draft_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepShape:
    """What one step computed, counted from its chunks (for benchmarks). A decode row adds
    one generated token to a sequence whose prompt is computed; every other row is a prefill
    row: prompt chunks, and positions recomputed after a preemption. `decode_keys`: the keys
    the decode rows attend to, summed (a row at position p attends to p + 1)."""

    prefill_rows: int = 0
    decode_rows: int = 0
    decode_keys: int = 0

    @classmethod
    def of(cls, layout: list[ChunkLogits]) -> StepShape:
        prefill = decode = keys = 0
        for part in layout:
            chunk = part.chunk
            rows = chunk.end - chunk.start
            if chunk.draft or (rows == 1 and chunk.start >= len(chunk.request.prompt_ids)):
                decode += rows  # a verify chunk's rows are decode rows, checked together
                keys += rows * chunk.start + rows * (rows + 1) // 2
            else:
                prefill += chunk.end - chunk.start
        return cls(prefill, decode, keys)


@dataclass
class LaunchedStep:
    """A step enqueued on the device whose results the host has not read yet.

    `sampling` lists the requests that choose a token and their logits row; `tokens` holds
    the chosen tokens on the device (one per sampling entry), which a step launched after this
    one reads for its pending rows. The chosen tokens and their logprobs are copied to pinned
    host memory at launch, so `chosen()` waits for this step's copy only, never for a step
    launched after it."""

    layout: list[ChunkLogits]
    logprobs: torch.Tensor  # [R, vocab] float32, on the device
    sampling: list[tuple[Request, int]]
    tokens: torch.Tensor | None = None
    # The final-normed hidden rows [R, hidden] behind `logprobs` (a runner that keeps them:
    # MTP drafting), else None.
    hidden: torch.Tensor | None = None
    # Launched without its token choice (`ModelRunner.sample` makes it): the sampling rows'
    # logits and logprobs, and how each row chooses.
    deferred: tuple[torch.Tensor, torch.Tensor, list[RowSampling]] | None = None
    _host: torch.Tensor | None = field(default=None, repr=False)  # [2, n] float64
    _ready: torch.cuda.Event | None = field(default=None, repr=False)

    def chosen(self) -> tuple[list[int], list[float]]:
        """The chosen tokens and their logprobs, one per sampling entry (the step's one host
        sync on greedy decode)."""
        if self._host is None:
            return [], []
        if self._ready is not None:
            self._ready.synchronize()
        tokens, logprobs = self._host.tolist()
        return [int(t) for t in tokens], logprobs

    def top_logprobs(self, row: int, k: int) -> tuple[tuple[int, float], ...]:
        """The k most likely tokens of logits row `row` and their logprobs (none for k=0)."""
        return top_logprobs(self.logprobs[row], k)

    def prompt_logprobs(self, part: ChunkLogits, k: int) -> list[TokenLogprob]:
        """Logprobs of prompt[p + 1] from the logits at each of the chunk's prompt positions
        p: one gather and one host transfer for the chunk; top alternatives when k > 0."""
        prompt = part.chunk.request.prompt_ids
        device = self.logprobs.device
        rows = self.logprobs.index_select(
            0, torch.tensor(part.prompt_rows, dtype=torch.int64, device=device)
        )
        token_ids = [prompt[p + 1] for p in part.prompt_positions]
        targets = torch.tensor(token_ids, dtype=torch.int64, device=device)
        values = rows.gather(1, targets[:, None])[:, 0].tolist()
        return [
            TokenLogprob(token, value, top_logprobs(rows[i], k))
            for i, (token, value) in enumerate(zip(token_ids, values, strict=True))
        ]

    def token_source(self) -> TokenSource:
        """Where a step launched after this one finds the tokens this one chooses."""
        assert self.tokens is not None, "a step that samples nothing has no tokens to give"
        return TokenSource(self.tokens, {id(r): i for i, (r, _) in enumerate(self.sampling)})


class ModelRunner:
    """Launches steps eagerly, pure decode steps (and verify steps of the same rows per
    sequence, where `graphs` has verify graphs) from CUDA graphs when `graphs` is given
    (same bits: see lockstep/engine/cuda_graphs.py), and steps with prompt rows from graph
    pieces around eager attention when `piecewise` is given
    (lockstep/engine/piecewise_graphs.py). `keep_hidden`: every step also keeps the
    final-normed hidden rows of its logits rows (`LaunchedStep.hidden`, for MTP drafting);
    such a runner runs eagerly (the graphs give logits only)."""

    def __init__(
        self,
        decoder: Decoder,
        kv: KVStorage,
        graphs: DecodeGraphRunner | None = None,
        piecewise: PiecewiseGraphRunner | None = None,
        keep_hidden: bool = False,
    ) -> None:
        assert not ((graphs or piecewise) and keep_hidden), "graphs give no hidden rows"
        self.decoder = decoder
        self.ops = decoder.ops
        self.kv = kv
        self.graphs = graphs
        self.piecewise = piecewise
        self.device = decoder.device
        self.keep_hidden = keep_hidden

    def launch(
        self,
        plan: list[ScheduledChunk],
        after: LaunchedStep | None = None,
        defer_processing: bool = False,
    ) -> LaunchedStep:
        """Enqueue the forward, log-softmax and token choice of `plan` (which the scheduler
        has already counted as computed). `after`: the launched step whose tokens this plan's
        pending rows take. `defer_processing`: when a sampling request processes its logits
        (its next logits need tokens the host has not seen yet), enqueue the forward only;
        `sample` makes the choice once the host has them. No host wait, the eager CUDA path's
        patch indices aside."""
        source = after.token_source() if after is not None and after.sampling else None
        logits, layout, hidden = self.forward(plan, source)
        logprobs = self.ops.log_softmax(logits)
        sampling = [
            (part.chunk.request, row)
            for part in layout
            if part.sample_row is not None
            for row in (part.sample_row, *part.draft_rows)
        ]
        step = LaunchedStep(layout, logprobs, sampling, hidden=hidden)
        if not sampling:
            return step
        # A verify chunk's rows choose the tokens of positions num_tokens, num_tokens + 1, ...
        # with the decode sampler, each at its own position.
        positions: list[int] = []
        for part in layout:
            if part.sample_row is not None:
                first = part.chunk.request.num_tokens
                positions.extend(range(first, first + 1 + len(part.draft_rows)))
        choices = [
            RowSampling(
                temperature=r.params.temperature, top_k=r.params.top_k, top_p=r.params.top_p,
                min_p=r.params.min_p, seed=r.seed, position=position,
            )
            for (r, _), position in zip(sampling, positions, strict=True)
        ]  # fmt: skip
        row_ids = [row for _, row in sampling]
        if row_ids == list(range(logits.shape[0])):  # decode steps: every row samples
            picked, picked_lps = logits, logprobs
        else:
            rows = torch.tensor(row_ids, dtype=torch.int64, device=logits.device)
            picked, picked_lps = logits.index_select(0, rows), logprobs.index_select(0, rows)
        step.deferred = (picked, picked_lps, choices)
        if not (defer_processing and any(r.params.processes_logits for r, _ in sampling)):
            self.sample(step)
        return step

    def sample(self, step: LaunchedStep) -> None:
        """Enqueue a launched step's token choice: logits processing (penalties, biases,
        bans, grammars: eagerly, on each request's own row, from the tokens the host holds),
        the choice, and the copy of tokens and logprobs to the host."""
        assert step.deferred is not None, "the step's tokens are already chosen"
        picked, picked_lps, choices = step.deferred
        step.deferred = None
        processed = process_logits(picked, [r for r, _ in step.sampling])
        step.tokens = choose_token_tensor(processed, choices)
        chosen = picked_lps.gather(1, step.tokens[:, None])[:, 0]
        # One transfer for tokens and their logprobs (float64 holds both exactly).
        both = torch.stack((step.tokens.double(), chosen.double()))
        if both.device.type == "cuda":
            step._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            step._host.copy_(both, non_blocking=True)
            step._ready = torch.cuda.Event()
            step._ready.record()
        else:
            step._host = both

    def build(
        self, plan: list[ScheduledChunk], source: TokenSource | None = None
    ) -> tuple[ForwardBatch, list[ChunkLogits], list[tuple[int, int]]]:
        """The step's batch (CPU tensors), its logits layout, and (row, index into
        source.tokens) for every row whose token is pending."""
        tokens: list[int] = []
        patches: list[tuple[int, int]] = []
        positions: list[int] = []
        out_slots: list[int] = []
        logit_rows: list[int] = []
        layout: list[ChunkLogits] = []
        q_counts, q_starts, tables = [], [], []
        for chunk in plan:
            req, start, end = chunk.request, chunk.start, chunk.end
            real_end = end - len(chunk.draft)  # a verify chunk's drafts follow its real tokens
            row0 = len(tokens)
            known = min(real_end, req.num_tokens - req.pending)
            tokens.extend(req.token_slice(start, known))
            for p in range(known, real_end):  # pending: a placeholder, patched on the device
                if source is None or id(req) not in source.index:
                    raise RuntimeError(f"{req.request_id}: position {p} is pending, no source")
                patches.append((row0 + p - start, source.index[id(req)]))
                tokens.append(0)
            tokens.extend(chunk.draft)
            positions.extend(range(start, end))
            out_slots.extend(req.slots.ids[start:end])
            q_counts.append(end - start)
            q_starts.append(start)
            tables.append(req.slots.array(end))
            prompt_positions: list[int] = []
            prompt_rows: list[int] = []
            if req.prompt_logprobs is not None:
                first = max(start, req.prompt_logprobs_next - 1)
                last = min(end, len(req.prompt_ids) - 1)
                for p in range(first, last):
                    prompt_positions.append(p)
                    prompt_rows.append(len(logit_rows))
                    logit_rows.append(row0 + p - start)
            sample_row = None
            draft_rows: list[int] = []
            if real_end == req.num_tokens:
                # Prompt positions stop at P-2, so the sampling row is never among them.
                sample_row = len(logit_rows)
                logit_rows.append(row0 + real_end - 1 - start)
                for p in range(real_end, end):
                    draft_rows.append(len(logit_rows))
                    logit_rows.append(row0 + p - start)
            layout.append(
                ChunkLogits(chunk, prompt_positions, prompt_rows, sample_row, tuple(draft_rows))
            )
        meta = build_attention_meta(q_counts, q_starts, tables)
        states = None
        if self.decoder.linear_layout is not None:
            states = [chunk.request.linear_state for chunk in plan]
            for chunk, state in zip(plan, states, strict=True):
                if state is None or state.position != chunk.start:
                    raise RuntimeError(f"{chunk.request.request_id}: linear state at "
                                       f"{getattr(state, 'position', None)}, chunk starts at "
                                       f"{chunk.start}")  # fmt: skip
        batch = ForwardBatch.from_lists(tokens, positions, out_slots, meta, logit_rows, states)
        return batch, layout, patches

    def forward(
        self, plan: list[ScheduledChunk], source: TokenSource | None = None
    ) -> tuple[torch.Tensor, list[ChunkLogits], torch.Tensor | None]:
        """Enqueue one forward pass; returns float32 logits [R, vocab] (on the model's device),
        which rows belong to which chunk, and the final-normed hidden rows behind the logits
        where the runner keeps them (else None)."""
        batch, layout, patches = self.build(plan, source)
        patch = (patches, source.tokens) if patches and source is not None else None
        if self.graphs is not None and self.graphs.can_run(batch):
            if patch is None or batch.meta.max_q == 1:  # pending tokens: decode graphs only
                return self.graphs.run(batch, patch), layout, None
        if self.piecewise is not None and self.piecewise.can_run(batch):
            return self.piecewise.run(batch, patch), layout, None
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        if patches and source is not None:
            rows, index = zip(*patches, strict=True)
            dev = batch.token_ids.device
            batch.token_ids.index_copy_(
                0,
                torch.tensor(rows, dtype=torch.int64, device=dev),
                source.tokens.index_select(0, torch.tensor(index, dtype=torch.int64, device=dev)),
            )
        if self.keep_hidden:
            # Decoder.forward is exactly these two calls: the logits keep their bits.
            hidden = self.decoder.hidden_states(batch, self.kv)
            return self.decoder.head_logits(hidden), layout, hidden
        return self.decoder.forward(batch, self.kv), layout, None
