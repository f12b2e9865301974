"""The per-step input of one forward pass: which tokens, where they sit, where their KV goes.

Built by the engine's model runner from the scheduler's plan and passed explicitly to the
decoder (no module-level context); it lives beside the decoder, which knows nothing of the
engine's requests. Rows of one sequence are contiguous and hold consecutive positions;
`meta` describes where each row's keys live in the KV pool (see `lockstep.ops.base`). For a
hybrid model, `linear_states` holds each sequence's linear-attention state (in sequence
order), which the step continues in place (lockstep.models.linear_attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lockstep.ops.base import AttentionMeta, PooledRows

if TYPE_CHECKING:
    from lockstep.models.linear_attention import LinearState, LinearStatePool


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    out_slots: torch.Tensor  # [T] int64, KV slot each row's key and value are written to
    meta: AttentionMeta
    logit_rows: torch.Tensor  # [R] int64, rows whose logits the step needs
    linear_states: list[LinearState] | None = None  # hybrid models: one per sequence
    # A CUDA graph's static decode step of a hybrid model: where its sequences sit in the
    # state pool, as device tensors (the decoder then neither reads rows on the host nor
    # advances states: the graph runner does).
    pooled: PooledRows | None = None
    state_pool: LinearStatePool | None = None

    @classmethod
    def from_lists(
        cls,
        token_ids: Sequence[int],
        positions: Sequence[int],
        out_slots: Sequence[int],
        meta: AttentionMeta,
        logit_rows: Sequence[int],
        linear_states: list[LinearState] | None = None,
    ) -> ForwardBatch:
        """A batch of CPU int64 tensors from the host lists a step is laid out in."""
        i64 = torch.int64
        return cls(
            token_ids=torch.tensor(token_ids, dtype=i64),
            positions=torch.tensor(positions, dtype=i64),
            out_slots=torch.tensor(out_slots, dtype=i64),
            meta=meta,
            logit_rows=torch.tensor(logit_rows, dtype=i64),
            linear_states=linear_states,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        return ForwardBatch(
            token_ids=self.token_ids.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            out_slots=self.out_slots.to(device, non_blocking=True),
            meta=self.meta.to(device),
            logit_rows=self.logit_rows.to(device, non_blocking=True),
            linear_states=self.linear_states,
            pooled=self.pooled,
            state_pool=self.state_pool,
        )
