"""Turns a scheduler plan into one forward pass and hands back the logits the step needs.

For each scheduled chunk the runner lays out rows (tokens, absolute positions, output slots),
the chunk's slot table for attention, and which rows need logits:
  * the last row, when the chunk reaches the end of the request's tokens (it samples);
  * rows whose logits give a still-owed prompt logprob (position p predicts prompt[p+1]).

A row whose token is still pending (chosen on the device by the step before, not yet on the
host: overlapped decode) is built with a placeholder and patched on the device from that
step's token tensor before the forward runs (`TokenSource`), so building never waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.engine.cuda_graphs import DecodeGraphRunner
from lockstep.engine.forward_batch import ForwardBatch
from lockstep.engine.scheduler import ScheduledChunk
from lockstep.models.decoder import Decoder, KVStorage
from lockstep.ops.base import build_attention_meta


@dataclass(frozen=True)
class TokenSource:
    """Where pending tokens come from: the launched step's chosen tokens (device, int64) and
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


class ModelRunner:
    """Runs steps eagerly, or pure decode steps from CUDA graphs when `graphs` is given (same
    bits: see lockstep/engine/cuda_graphs.py)."""

    def __init__(
        self, decoder: Decoder, kv: KVStorage, graphs: DecodeGraphRunner | None = None
    ) -> None:
        self.decoder = decoder
        self.kv = kv
        self.graphs = graphs
        self.device = decoder.device

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
            row0 = len(tokens)
            known = min(end, req.num_tokens - req.pending)
            tokens.extend(req.token_slice(start, known))
            for p in range(known, end):  # pending: a placeholder, patched on the device
                if source is None or id(req) not in source.index:
                    raise RuntimeError(f"{req.request_id}: position {p} is pending, no source")
                patches.append((row0 + p - start, source.index[id(req)]))
                tokens.append(0)
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
            if end == req.num_tokens:
                # Prompt positions stop at P-2, so the sampling row is never among them.
                sample_row = len(logit_rows)
                logit_rows.append(row0 + end - 1 - start)
            layout.append(ChunkLogits(chunk, prompt_positions, prompt_rows, sample_row))
        i64 = torch.int64
        batch = ForwardBatch(
            token_ids=torch.tensor(tokens, dtype=i64),
            positions=torch.tensor(positions, dtype=i64),
            out_slots=torch.tensor(out_slots, dtype=i64),
            meta=build_attention_meta(q_counts, q_starts, tables),
            logit_rows=torch.tensor(logit_rows, dtype=i64),
        )
        return batch, layout, patches

    def run(
        self, plan: list[ScheduledChunk], source: TokenSource | None = None
    ) -> tuple[torch.Tensor, list[ChunkLogits]]:
        """Launch one forward step; returns float32 logits [R, vocab] (on the model's device)
        and which rows belong to which chunk. Never waits for the device unless a CPU tensor
        must be read (the eager CUDA path's patch indices)."""
        batch, layout, patches = self.build(plan, source)
        if self.graphs is not None and self.graphs.can_run(batch):
            patch = (patches, source.tokens) if patches and source is not None else None
            return self.graphs.run(batch, patch), layout
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
        logits = self.decoder.forward(batch, self.kv)
        return logits, layout
