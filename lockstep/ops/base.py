"""The numeric layer's interface: what the decoder asks of every backend.

Backends (see `lockstep.ops.get_ops`):
  * `cpu_deterministic` - C++ kernels, position invariant by construction (default on CPU);
  * `cpu_stock`         - plain torch ops (F.linear, SDPA): `--mode reference`, the negative
                          control;
  * `gpu_deterministic` - Triton kernels (default on CUDA);
  * `gpu_stock`         - cuBLAS and torch SDPA: `--mode reference` on CUDA;
  * `float64`           - float64 torch, the oracle, for tests only.

The contract every deterministic backend keeps (docs/design.md):
each output row is computed by the same sequence of floating-point operations whatever the
number of rows M in the call, the row's index in the call, the thread count, or (for
attention) how the sequence was split into query chunks. Reductions run in one fixed order
that depends only on the reduced length and on absolute key positions.

Shapes use T for the number of token rows in a forward step (all sequences concatenated).

Attention metadata (varlen layout; the query rows of one sequence are contiguous and hold
consecutive absolute positions):

    sequence b:  query rows  cu_q[b] .. cu_q[b+1]-1
                 positions   q_start[b] .. q_start[b] + n_b - 1      (n_b = cu_q[b+1]-cu_q[b])
                 keys        positions 0 .. kv_len[b]-1,  kv_len[b] = q_start[b] + n_b
                 key j lives in cache slot  slot_table[cu_kv[b] + j]

    query row at position p sees keys 0..p (causal), including its own key, which the
    decoder writes to the cache (attention_input) before calling attention.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from lockstep.ops.fp8 import E4M3, Fp8Weight, e4m3_sat, quantize_kv

if TYPE_CHECKING:
    from lockstep.ops.moe import MoeLayer, Routing


@dataclass(frozen=True)
class AttentionMeta:
    """Where each query row's keys live. All tensors are int32 on the compute device."""

    cu_q: torch.Tensor  # [B+1]
    q_start: torch.Tensor  # [B]
    kv_len: torch.Tensor  # [B]
    cu_kv: torch.Tensor  # [B+1]
    slot_table: torch.Tensor  # [cu_kv[B]]
    max_q: int  # max n_b (python int, for grid sizes)
    max_kv: int  # max kv_len[b]

    @property
    def num_seqs(self) -> int:
        return int(self.q_start.shape[0])

    def to(self, device: torch.device | str) -> AttentionMeta:
        return AttentionMeta(
            cu_q=self.cu_q.to(device),
            q_start=self.q_start.to(device),
            kv_len=self.kv_len.to(device),
            cu_kv=self.cu_kv.to(device),
            slot_table=self.slot_table.to(device),
            max_q=self.max_q,
            max_kv=self.max_kv,
        )


class LayerKV(NamedTuple):
    """One layer's K and V caches, [S, Hkv, D] each (rows are KV slots), and the static scales
    of an FP8 cache (`lockstep.ops.fp8`, "FP8 KV cache": k is stored as e4m3_sat(k / k_scale)
    and read as k_scale times the stored value); 1.0, and unused, for any other cache."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class AttentionInput:
    """What `Ops.attention_input` needs of one layer besides the step's rows: the query head
    count, the per-head q/k RMSNorm weights [D] (Qwen3; None for models without them) and
    their epsilon, and the RoPE tables cos, sin: float32 [max_position, D/2] indexed by
    absolute position, computed once at load."""

    num_heads: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor


def build_attention_meta(
    q_counts: list[int],
    q_starts: list[int],
    slot_tables: list[list[int]] | list[torch.Tensor] | list[np.ndarray],
) -> AttentionMeta:
    """Build metadata on the CPU from per-sequence query counts, first positions and slot
    tables (slot_tables[b] must hold at least q_starts[b] + q_counts[b] entries). The tables
    (the engine's are int32 numpy views; lists and CPU tensors are taken too) are joined by
    one numpy concatenation, without a tensor per sequence."""
    if len(slot_tables) != len(q_counts):
        raise ValueError(f"{len(slot_tables)} slot tables for {len(q_counts)} sequences")
    kv_len = [start + n for n, start in zip(q_counts, q_starts, strict=True)]
    short = next((i for i, t in enumerate(slot_tables) if len(t) < kv_len[i]), None)
    if short is not None:
        raise ValueError(f"slot table of {len(slot_tables[short])} entries for "
                         f"{kv_len[short]} keys")  # fmt: skip
    parts = [t[:n] if isinstance(t, np.ndarray) else np.asarray(t[:n])
             for t, n in zip(slot_tables, kv_len, strict=True)]  # fmt: skip
    joined = np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, np.int32)
    i32 = torch.int32
    return AttentionMeta(
        cu_q=torch.tensor([0, *np.cumsum(q_counts, dtype=np.int64).tolist()], dtype=i32),
        q_start=torch.tensor(list(q_starts), dtype=i32),
        kv_len=torch.tensor(kv_len, dtype=i32),
        cu_kv=torch.tensor([0, *np.cumsum(kv_len, dtype=np.int64).tolist()], dtype=i32),
        slot_table=torch.from_numpy(joined),
        max_q=max(q_counts, default=0),
        max_kv=max(kv_len, default=0),
    )


@runtime_checkable
class DenseOps(Protocol):
    """Dense math every block needs: linears, norms, SiLU-mul, log-softmax. Activations are
    float32 on the CPU backends and the model dtype (bfloat16 or float32) on the GPU;
    accumulation is always float32."""

    name: str
    deterministic: bool

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Return the weight [N, K] in whatever layout `linear` wants (called once at load)."""
        ...

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] @ weight.T -> [M, N] (+ bias). Row m depends only on x[m]."""
        ...

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight.T -> [M, N] float32, not rounded to x's dtype: one partial sum of
        a row-parallel linear (lockstep.parallel.layers), computed exactly as `linear` would
        compute it before rounding. Row m depends only on x[m]."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [M, H] -> x / sqrt(mean(x^2) + eps) * weight, one row at a time."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual' = x + residual; returns (rms_norm(residual'), residual')."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] (gate first) -> silu(gate) * up, [M, I]."""
        ...

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] -> float32 log-probabilities, one row at a time."""
        ...


@runtime_checkable
class Fp8Ops(Protocol):
    """FP8 linears (lockstep/ops/fp8.py)."""

    def prepare_fp8_linear(
        self,
        scheme: str,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
    ) -> Fp8Weight:
        """An FP8 linear (e4m3 weight [N, K] and fp32 scales in the canonical form of
        `lockstep.ops.fp8`) in whatever form `fp8_linear` wants (called once at load)."""
        ...

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] @ W.T -> [M, N] (+ bias) as `lockstep.ops.fp8` defines it: the activation
        quantized row-locally (or with the static scale), scales applied per 128-wide K
        block. Row m depends only on x[m] in a deterministic backend."""
        ...


@runtime_checkable
class PagedAttentionOps(Protocol):
    """Causal attention over the paged K/V cache (lockstep/models/blocks/attention.py)."""

    def attention_input(
        self, qkv: Tensor, layer: AttentionInput, positions: Tensor, slots: Tensor, kv: LayerKV
    ) -> Tensor:
        """From the fused projection rows qkv [T, (Hq + 2 Hkv) D] (q | k | v; Hq =
        layer.num_heads, Hkv and D those of the caches kv [S, Hkv, D]): per-head RMSNorm of q
        and k where the model has one (Qwen3), RoPE at `positions`, k and v written to the
        caches at `slots` (an FP8 cache: as e4m3 at kv.k_scale and kv.v_scale,
        `lockstep.ops.fp8.quantize_kv`); returns q [T, Hq, D]. Every value is computed per
        token."""
        ...

    def attention(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMeta,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over the paged cache -> [T, Hq, D] (q's dtype).
        Keys are visited in blocks at fixed absolute positions, never relative to the query
        chunk; workspace never grows with the context length. `window` (sliding-window
        layers): the row at position p sees keys p - window + 1 .. p only; key blocks wholly
        outside a row's window are skipped or are exact identities on its softmax state, so
        its bits still depend on its own keys alone. An FP8 cache's keys and values are read
        at kv.k_scale and kv.v_scale, the same way on every path (`lockstep.ops.fp8`, "FP8
        KV cache")."""
        ...


@runtime_checkable
class SoftcapOps(Protocol):
    """Logit soft-capping (Gemma's final_logit_softcapping)."""

    def softcap(self, x: Tensor, cap: float) -> Tensor:
        """cap * tanh(x / cap) per element, float32 in and out."""
        ...


@runtime_checkable
class TargetLogSoftmaxOps(Protocol):
    """One log-probability per row without the [R, V] log-probabilities (the training
    module's chunked LM head, lockstep/training/token_logprobs.py)."""

    def target_log_softmax(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """(log_softmax(logits)[r, targets[r]] [R] float32, bit for bit what `log_softmax`
        gives there, and each row's logsumexp [R] float32)."""
        ...


@runtime_checkable
class GeluOps(Protocol):
    """The GeGLU activation (Gemma's gelu_pytorch_tanh MLP)."""

    def gelu_tanh_mul(self, gate_up: Tensor) -> Tensor:
        """gate_up [M, 2I] (gate first) -> gelu_tanh(gate) * up, [M, I], per element, where
        gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) = g / (1 + exp(-2u)),
        u = sqrt(2/pi) (g + 0.044715 g^3)."""
        ...


@runtime_checkable
class GatedOutputOps(Protocol):
    """An elementwise output gate (Qwen3.5's gated attention and gated DeltaNet norm)."""

    def gate_activation(self, x: Tensor, gate: Tensor, kind: str) -> Tensor:
        """x * sigmoid(gate) (kind "sigmoid") or x * silu(gate) ("silu"), per element, in x's
        dtype."""
        ...


@runtime_checkable
class LinearAttentionOps(Protocol):
    """Gated DeltaNet (lockstep/models/linear_attention.py), float32 throughout."""

    def gdn_gates(
        self, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor
    ) -> tuple[Tensor, Tensor]:
        """a, b [T, Hv] -> (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b))."""
        ...

    def l2_normalize(self, x: Tensor, eps: float, scale: float) -> Tensor:
        """x [R, D] -> x / sqrt(sum(x^2) + eps) * scale, one row at a time."""
        ...

    def silu(self, x: Tensor) -> Tensor:
        """x / (1 + exp(-x)) per element."""
        ...

    def gated_delta_rule(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        state: Tensor,
        open_k: Tensor,
        open_gamma: Tensor,
        open_u: Tensor,
        start: int,
    ) -> tuple[Tensor, list[tuple[int, Tensor]]]:
        """The gated delta rule over one sequence's rows at positions start.. (q, k [n, Hk,
        Dk] L2-normalized, q scaled; v [n, Hv, Dv]; g, beta [n, Hv]), continuing the state
        and open rows of `LinearState` in place (chunk C = open_k.shape[0]). Returns the
        outputs [n, Hv, Dv] and (position, state [Hv, Dk, Dv]) at chunk boundaries crossed.
        A deterministic backend computes each row by the per-row formula of the CPU kernel
        (`gdn_rule`) and returns every boundary; a stock one may return fewer."""
        ...


@dataclass(frozen=True)
class PooledRows:
    """Where each sequence of a step sits, as int32 device tensors built once per step: its
    rows cu [B + 1], first position starts [B], last position + 1 ends [B], state pool slot
    slots [B], each row's sequence row_seq [T]; the chunk boundaries each sequence crosses
    before its last row ("crossings", in order) start at bound_at [B] in bound_index [M], which
    gives each crossing's index in the boundary buffers, or -1 where it is not captured; per
    captured boundary its sequence bound_seq [N] and position bound_pos [N]; `seq_ids` and
    `bound_ids` count 0.. (B and N). The host copy: `boundaries` [(sequence, position)] of the
    captured ones and `bound_count` N. Chunk tasks (the chunked rule, lockstep/ops/triton/
    chunked_delta.py): each piece of a sequence's rows that falls in one chunk, in order, is a
    task with its sequence task_seq [K], first position task_pos [K], first row of the step
    task_row [K] and row count task_n [K]; sequence b's tasks are task_cu[b] .. task_cu[b+1]
    - 1 [B + 1]; `task_count` K on the host."""

    cu: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    slots: torch.Tensor
    bound_at: torch.Tensor
    bound_index: torch.Tensor
    row_seq: torch.Tensor
    bound_seq: torch.Tensor
    bound_pos: torch.Tensor
    seq_ids: torch.Tensor
    bound_ids: torch.Tensor
    boundaries: list[tuple[int, int]]
    task_seq: torch.Tensor | None = None
    task_pos: torch.Tensor | None = None
    task_row: torch.Tensor | None = None
    task_n: torch.Tensor | None = None
    task_cu: torch.Tensor | None = None
    task_count: int = 0

    @property
    def bound_count(self) -> int:
        return len(self.boundaries)

    @classmethod
    def build(
        cls, rows: list[int], starts: list[int], slots: list[int], chunk: int,
        device: torch.device, keep: Callable[[int, int], bool] | None = None,
    ) -> PooledRows:  # fmt: skip
        """From host lists. A crossing is a multiple of `chunk` a sequence crosses before its
        last row (one at the last row is the state the step leaves in the slot); it is
        captured where `keep(sequence, position)` says so (all of them without `keep`)."""
        crossings = [
            (i, p)
            for i, (s, n) in enumerate(zip(starts, rows, strict=True))
            for p in range((s // chunk + 1) * chunk, s + n, chunk)
        ]
        boundaries = [c for c in crossings if keep is None or keep(*c)]
        counts = [0] * len(rows)
        for i, _ in crossings:
            counts[i] += 1
        index = iter(range(len(boundaries)))
        captured = set(boundaries)
        b, nb = len(rows), len(boundaries)
        tasks = []  # (sequence, first position, first row of the step, rows)
        row = 0
        for i, (s, n) in enumerate(zip(starts, rows, strict=True)):
            p = s
            while p < s + n:
                m = min(s + n - p, chunk - p % chunk)
                tasks.append((i, p, row + p - s, m))
                p += m
            row += n
        per_seq = [0] * b
        for i, *_ in tasks:
            per_seq[i] += 1
        lists = (
            [0, *itertools.accumulate(rows)],
            starts,
            [s + n for s, n in zip(starts, rows, strict=True)],
            slots,
            [0, *itertools.accumulate(counts)][:-1],
            [next(index) if c in captured else -1 for c in crossings],
            [i for i, n in enumerate(rows) for _ in range(n)],
            [i for i, _ in boundaries],
            [p for _, p in boundaries],
            list(range(b)),
            list(range(nb)),
            *([t[f] for t in tasks] for f in range(4)),
            [0, *itertools.accumulate(per_seq)],
        )
        host = torch.tensor([x for part in lists for x in part], dtype=torch.int32)
        parts = host.to(device, non_blocking=True).split([len(part) for part in lists])
        return cls(*parts[:11], boundaries, *parts[11:], task_count=len(tasks))


@runtime_checkable
class PooledLinearAttentionOps(Protocol):
    """Gated DeltaNet over all sequences of a step at once, each continuing the state in its
    slot of a `LinearStatePool` (lockstep/models/linear_attention.py): a launch per kernel
    and layer instead of one per sequence, each row computed as `LinearAttentionOps` computes
    it (optional: without it the layers loop over the sequences)."""

    def causal_conv_silu_pooled(
        self, mixed: Tensor, windows: Tensor, weight: Tensor, seqs: PooledRows
    ) -> Tensor:
        """silu(causal conv) of the step's rows mixed [T, CD] -> float32 [T, CD], the rows
        before each sequence's first from its window in `windows` [S, K-1, CD]."""
        ...

    def update_conv_windows(
        self, mixed: Tensor, windows: Tensor, weight: Tensor, seqs: PooledRows
    ) -> Tensor:
        """After the conv: the windows at the step's boundaries [N, K-1, CD]; each slot's
        window moved to its sequence's end, in place."""
        ...

    def gated_delta_rule_pooled(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
        open_k: Tensor, open_gamma: Tensor, open_u: Tensor, seqs: PooledRows,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """`gated_delta_rule` for every sequence of the step, states and open rows at the
        sequences' slots of the pool tensors (one layer's); returns out [T, Hv, Dv] and the
        boundary states before each sequence's last row [N, Hv, Dk, Dv]."""
        ...


@runtime_checkable
class ChunkedLinearAttentionOps(Protocol):
    """The chunked gated delta rule (lockstep/ops/chunked_delta.py: formulas and why a row's
    bits do not depend on the schedule), for `gdn_kernel="chunked"`."""

    def chunked_delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
        open_k: Tensor, open_v: Tensor, open_g: Tensor, open_beta: Tensor, start: int,
    ) -> tuple[Tensor, list[tuple[int, Tensor]]]:  # fmt: skip
        """`gated_delta_rule`'s contract with the open chunk's rows kept as they arrived (keys
        [C, Hk, Dk], values [C, Hv, Dv], log gates and betas [C, Hv]); every boundary."""
        ...


@runtime_checkable
class PooledChunkedLinearAttentionOps(Protocol):
    """`chunked_delta_rule` over every sequence of a step, states and open rows at the
    sequences' slots of a `LinearStatePool` (with `PooledLinearAttentionOps`' convolution)."""

    def chunked_delta_rule_pooled(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
        open_k: Tensor, open_v: Tensor, open_g: Tensor, open_beta: Tensor, seqs: PooledRows,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Returns out [T, Hv, Dv] and the boundary states before each sequence's last row
        [N, Hv, Dk, Dv] (`seqs.boundaries` order)."""
        ...


@runtime_checkable
class MoeOps(Protocol):
    """The routed-experts MLP (lockstep/ops/moe.py)."""

    def moe(
        self, x: torch.Tensor, layer: MoeLayer, routed_experts: Tensor | None = None
    ) -> torch.Tensor:
        """The routed-experts MLP of one sparse layer: x [T, H] -> [T, H] (x's dtype on the
        GPU, float32 on the CPU). fp32 router logits, each token's top-k experts (ties toward
        the lower id), softmax weights (renormalized over the k if asked), the k expert
        outputs combined in ascending rank in fp32, no capacity limit. A deterministic
        backend computes every token from its own row alone: the contract is in
        `lockstep.ops.moe`. FP8 experts (`layer.fp8`, in `layer.fp8_scheme`): each expert
        GEMM is the backend's FP8 linear arithmetic ("FP8 experts" there).

        `routed_experts`: an integer tensor [T, top_k] the op overwrites with each token's
        experts in rank order (the ids it routed by; routing replay, lockstep/ops/moe.py
        "Routed expert ids"). Writing it changes no bit of the output, and on the GPU it is a
        device copy inside the op, so a CUDA graph holds it."""
        ...

    def moe_route(self, x: torch.Tensor, layer: MoeLayer) -> Routing:
        """Steps 1-3 of `moe` alone (DeepSeek's 2'-3' where `layer.deepseek`): each token's
        experts in rank order and their fp32 weights, from `layer.router`, `top_k`,
        `renormalize` and `deepseek` (the experts are not read). The same bits as the routing
        inside `moe`. The sharded experts (lockstep/parallel/experts.py) route by it, so
        every rank routes identically and runs its own slice of the chosen experts."""
        ...


@runtime_checkable
class DeepseekRoutingOps(Protocol):
    """DeepSeek's routing inside `MoeOps.moe` (lockstep/ops/moe.py, "DeepSeek routing"):
    sigmoid or softmax scores, a correction bias for the choice, expert groups, a routed
    scaling factor. A backend without it cannot run DeepSeek MoE layers."""

    def route_deepseek(self, logits: Tensor, layer: MoeLayer) -> Routing:
        """Each token's experts (rank order) and weights from fp32 router logits [T, E] and
        `layer.deepseek`; a deterministic backend keeps steps 2'-3' of `lockstep.ops.moe`."""
        ...


@runtime_checkable
class LatentAttentionOps(Protocol):
    """Multi-head latent attention in the absorbed form (DeepSeek-V2/V3,
    lockstep/models/blocks/mla.py): one cache row per token and layer, [S, 1, W], holding the
    normalized latent (its first Dv values, which are also the token's value) and the rotated
    RoPE key (the rest); every query head attends over the same rows."""

    def rope(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate-half RoPE of x [T, H, D] at `positions` from float32 tables [max_position,
        D/2], in x's dtype, per element (`ComposedAttentionInput`)."""
        ...

    def write_latent(self, cache: Tensor, rows: Tensor, slots: Tensor) -> None:
        """Copy rows [T, W] into cache [S, 1, W] at `slots` [T], rounded to the cache's dtype
        (float8_e4m3fn: saturating, at scale 1.0), exactly."""
        ...

    def write_latent_row(
        self, cache: Tensor, latent: Tensor, k_rope: Tensor, positions: Tensor, cos: Tensor,
        sin: Tensor, slots: Tensor,
    ) -> None:  # fmt: skip
        """A token's cache row from its parts: latent [T, R] (normalized) and the RoPE part of
        the projection k_rope [T, dr] (a strided view is fine: last dim contiguous) give the
        row latent | rope(k_rope) written into cache [S, 1, R + dr] at `slots` [T]. The bits
        of `ComposedLatentInput.write_latent_row`: `rope` at `positions` from the float32
        tables [max_position, dr/2], rounded to k_rope's dtype, then `write_latent`'s
        rounding to the cache's dtype; every value is computed per token."""
        ...

    def latent_query(
        self, q_lat: Tensor, q_rope: Tensor, positions: Tensor, cos: Tensor, sin: Tensor
    ) -> Tensor:
        """The absorbed query [T, H, R + dr] (contiguous, q_lat's dtype) from q_lat [T, H, R]
        (W_UK^T q_nope per head) and the RoPE part of q, q_rope [T, H, dr] (a strided view is
        fine: last dim contiguous): q_lat | rope(q_rope) rounded to q_rope's dtype, then to
        q_lat's, bit for bit `ComposedLatentInput.latent_query`; per token and head."""
        ...

    def latent_width_refusal(self, latent: int, rope: int) -> str | None:
        """Why this backend cannot run latent attention over rows of `latent` + `rope` values
        (a model of those widths is refused at load with it), or None where it can."""
        ...

    def grouped_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """MLA's absorbed projections, heads as groups, in one op: x [T, G, K] (K contiguous;
        a strided view is fine) and weight [G, N, K] give [T, G, N] whose row (t, g) is
        `linear(x[t, g], weight[g])` bit for bit (this backend's linear: the same K order,
        for every T and G); rows are never mixed between groups."""
        ...

    def latent_attention(
        self, q: Tensor, cache: Tensor, meta: AttentionMeta, scale: float, value_dim: int
    ) -> Tensor:
        """Causal attention of q [T, H, W] over the cache rows [S, 1, W] of each query's keys
        0..p: scores q . row * scale, values row[:value_dim]; returns [T, H, value_dim] in q's
        dtype. A deterministic backend visits keys in blocks at fixed absolute positions and
        computes a row's scores, softmax and sum in one order that depends on its position
        alone (the CPU kernel's header), so prefill, chunks and decode give the same bits."""
        ...


class Ops(
    DenseOps,
    Fp8Ops,
    PagedAttentionOps,
    GatedOutputOps,
    GeluOps,
    SoftcapOps,
    LinearAttentionOps,
    MoeOps,
    Protocol,
):
    """A full backend: every capability above. A block declares the capabilities its forward
    calls (`Block.requires`); a model whose blocks need one the backend lacks is refused at load
    (lockstep/models/decoder.py)."""


class IndexCopyKVWrite:
    """`write_kv` (for `ComposedAttentionInput`) as an exact torch copy (index_copy_): k, v
    [T, Hkv, D] into caches [S, Hkv, D] at rows `slots` [T], rounded to the cache's dtype
    (float8_e4m3fn: `lockstep.ops.fp8.quantize_kv` at the layer's scales); and
    `write_latent` (`LatentAttentionOps`), the same copy of one latent row per token."""

    def write_latent(self, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        index = slots.to(torch.int64)
        rows = rows.reshape(rows.shape[0], *cache.shape[1:])
        if cache.dtype == E4M3:  # no index_copy_ for fp8: copy the bytes
            cache.view(torch.uint8).index_copy_(0, index, e4m3_sat(rows.float()).view(torch.uint8))
            return
        cache.index_copy_(0, index, rows.to(cache.dtype))

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        index = slots.to(torch.int64)
        if k_cache.dtype == E4M3:  # no index_copy_ for fp8: copy the bytes
            for cache, new, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
                stored = quantize_kv(new, scale)
                cache.view(torch.uint8).index_copy_(0, index, stored.view(torch.uint8))
            return
        k_cache.index_copy_(0, index, k.to(k_cache.dtype))
        v_cache.index_copy_(0, index, v.to(v_cache.dtype))


class GroupedLinearByGroups:
    """`LatentAttentionOps.grouped_linear` as one `linear` per group: the contract's bits by
    construction, for backends where a launch costs nothing worth fusing (the CPU)."""

    def grouped_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        linear = self.linear  # type: ignore[attr-defined]
        return torch.stack([linear(x[:, g].contiguous(), weight[g]) for g in range(x.shape[1])], 1)


class ComposedLatentInput:
    """`LatentAttentionOps.write_latent_row` and `latent_query` composed from the backend's own
    `rope` and `write_latent` and torch's exact copies (cat): the definition of their bits.
    (The GPU deterministic backend does each in one Triton kernel with these bits:
    lockstep/ops/triton/latent_input.py.)"""

    def write_latent_row(
        self, cache: Tensor, latent: Tensor, k_rope: Tensor, positions: Tensor, cos: Tensor,
        sin: Tensor, slots: Tensor,
    ) -> None:  # fmt: skip
        t, dr = k_rope.shape
        k_pe = self.rope(k_rope.reshape(t, 1, dr).contiguous(), positions, cos, sin)
        self.write_latent(cache, torch.cat([latent, k_pe.reshape(t, dr)], dim=1), slots)

    def latent_query(
        self, q_lat: Tensor, q_rope: Tensor, positions: Tensor, cos: Tensor, sin: Tensor
    ) -> Tensor:
        q_pe = self.rope(q_rope.contiguous(), positions, cos, sin)
        return torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=2).contiguous()


class ComposedAttentionInput:
    """`Ops.attention_input` composed from the backend's own `rms_norm` and two more ops it
    must have: `rope(x [T, H, D], positions [T], cos, sin)`, neox-style rotary embedding
    (rotate_half) from float32 tables [max_position, D/2] indexed by absolute position, in x's
    dtype; and `write_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale)`, an exact copy of
    k, v [T, Hkv, D] into the caches [S, Hkv, D] at rows `slots` [T] (an FP8 cache's values
    divided by its scales first). (The GPU deterministic backend fuses all
    of it into one kernel and has neither.)"""

    def attention_input(
        self, qkv: Tensor, layer: AttentionInput, positions: Tensor, slots: Tensor, kv: LayerKV
    ) -> Tensor:
        t, hq, (hkv, d) = qkv.shape[0], layer.num_heads, kv.k.shape[1:]
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        q = q.reshape(t, hq, d)
        k = k.reshape(t, hkv, d)
        v = v.reshape(t, hkv, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = self.rms_norm(q.reshape(-1, d), layer.q_norm, layer.eps).reshape(t, hq, d)
            k = self.rms_norm(k.reshape(-1, d), layer.k_norm, layer.eps).reshape(t, hkv, d)
        q = self._rotate(q, positions, layer)
        k = self._rotate(k, positions, layer)
        self.write_kv(kv.k, kv.v, k, v, slots, kv.k_scale, kv.v_scale)
        return q

    def _rotate(self, x: Tensor, positions: Tensor, layer: AttentionInput) -> Tensor:
        """RoPE on the first 2 * cos.shape[1] dims of each head (all of them but for partial
        rotary embeddings, Qwen3.5); the rest pass through."""
        rot = 2 * layer.cos.shape[1]
        if rot == x.shape[-1]:
            return self.rope(x, positions, layer.cos, layer.sin)
        turned = self.rope(x[..., :rot].contiguous(), positions, layer.cos, layer.sin)
        return torch.cat([turned, x[..., rot:].to(turned.dtype)], dim=-1)
