"""The routing store: every cached token's routed experts, kept beside its KV (routing replay).

A mixture-of-experts trainer that replays the rollout's routing (slime's routing replay) needs
the experts each token went to in each sparse layer. The engine keeps them where it keeps the
token's K/V: one row per KV slot,

    store [pool slots, sparse layers, top_k]   int16 (int32 past 32767 experts)

written by each sparse layer's `Ops.moe` at the step's output slots (lockstep/models/blocks/
moe.py) and read back at a request's end from its slot table. Because a row is written
exactly when its slot's K/V is, everything that keeps a slot keeps its routing: a radix-cache
hit returns the prompt's routing as the cold run computed it, and preemption recomputes both.
By position invariance the ids are those of a cold full prefill, bit for bit (the ids are a
function of the token's router logits, which are).

Allocated only when the engine is started with `enable_return_routed_experts`, and counted in
the pool's bytes per token (lockstep/engine/memory.py), so the pool stays honestly sized.

A request's routing leaves the engine in SGLang's layout (`sglang_layout`): int32
[len - 1, num_hidden_layers, top_k] (len = prompt + output tokens: every position that ran a
forward; the last token never did), layer index = decoder layer, rows of dense layers
(DeepSeek's first layers, `mlp_only_layers`) zero as SGLang leaves them. On the wire it is
base64 of those bytes (lockstep/server/routed_experts_field.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from lockstep.models.spec import ModelSpec

INT16_MAX_EXPERTS = 32767


def store_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer type that holds every expert id."""
    return torch.int16 if num_experts <= INT16_MAX_EXPERTS else torch.int32


def store_row_shape(spec: ModelSpec) -> tuple[int, int]:
    """(sparse layers, top_k) of one slot's routing; the model must have routed experts."""
    if spec.moe is None:
        raise ValueError("a routing store needs a mixture-of-experts model")
    return len(spec.moe.sparse_layers), spec.moe.top_k


def bytes_per_token(spec: ModelSpec) -> int:
    """What one slot's routing costs (0 for a model without routed experts)."""
    if spec.moe is None:
        return 0
    layers, top_k = store_row_shape(spec)
    return layers * top_k * store_dtype(spec.moe.num_experts).itemsize


def sglang_layout(spec: ModelSpec, rows: torch.Tensor) -> np.ndarray:
    """Store rows [n, sparse layers, top_k] -> int32 [n, num_hidden_layers, top_k], each sparse
    layer's ids at its decoder layer index, dense layers' rows zero (SGLang's layout)."""
    assert spec.moe is not None
    out = np.zeros((rows.shape[0], spec.num_layers, spec.moe.top_k), dtype=np.int32)
    out[:, list(spec.moe.sparse_layers)] = rows.cpu().numpy().astype(np.int32)
    return out
