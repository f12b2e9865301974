"""Turns a scheduler plan into one forward pass and hands back the logits the step needs.

For each scheduled chunk the runner lays out rows (tokens, absolute positions, output slots),
the chunk's slot table for attention, and which rows need logits:
  * the last row, when the chunk reaches the end of the request's tokens (it samples);
  * rows whose logits give a still-owed prompt logprob (position p predicts prompt[p+1]).
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

    def build(self, plan: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ChunkLogits]]:
        tokens: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        logit_rows: list[int] = []
        layout: list[ChunkLogits] = []
        q_counts, q_starts, tables = [], [], []
        for chunk in plan:
            req, start, end = chunk.request, chunk.start, chunk.end
            row0 = len(tokens)
            tokens.extend(req.token_slice(start, end))
            positions.extend(range(start, end))
            out_slots.extend(req.slots.ids[start:end])
            q_counts.append(end - start)
            q_starts.append(start)
            tables.append(req.slots.tensor(end))
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
        return batch, layout

    def run(self, plan: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ChunkLogits]]:
        """Run one forward step; returns float32 logits [R, vocab] (on the model's device)
        and which rows belong to which chunk."""
        batch, layout = self.build(plan)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch), layout
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        logits = self.decoder.forward(batch, self.kv)
        return logits, layout
