"""The routed-experts MLP (`Ops.moe`): its weights, its contract, and the pieces backends share.

The contract (docs/design.md, "Mixture of experts"), for activations x [T, H]:

  1. Router logits l = linear(x, router) [T, E] in fp32, through the backend's linear (in a
     deterministic backend a row's bits do not depend on the other rows).
  2. A token's experts are its top_k logits in rank order, the largest first; among equal
     logits the lower expert id ranks first.
  3. Their weights are softmax probabilities: w_r = exp(l_r - l_0) / s, where s sums
     exp(l_j - l_0) over the k chosen experts (renormalize, Hugging Face's norm_topk_prob) or
     over all E. Each backend fixes the order of that sum (the CPU kernel: ascending rank, or
     its lane-partial tree over E; `route_sorted`: see there).
  4. Slot (token, rank r) holds expert e_r's output y_r = down_e(silu(gate_e x) * up_e x),
     computed by the backend's own linear and silu_mul on the expert's [N, K] weights. The
     deterministic linears are M-invariant, so y_r does not depend on how many tokens expert
     e_r received this step or which ones.
  5. out = w_0 y_0 + w_1 y_1 + ... + w_{k-1} y_{k-1} in fp32, added in ascending rank
     (`combine_in_rank_order`), then rounded once to x's dtype.

No capacity limit: every token gets all of its k experts, whatever its batch-mates chose.
Every step above is per token, so a token's output is a function of its own row of x.

DeepSeek routing (`MoeLayer.deepseek`, `route_deepseek`) replaces steps 2-3:

  2'. Scores: s = sigmoid(l) per element (DeepSeek-V3, GLM-4.7-Flash) or the softmax
      probabilities over all E (DeepSeek-V2), by the backend's own per-element kernel.
      Choice scores c = s + b, b the checkpoint's per-expert correction bias (zero without).
      With G > 1 groups of E/G consecutive experts, each group scores the max of its c
      ("max") or the sum of its two largest c, larger + smaller ("top2_sum"); the topk_groups
      best groups are kept (ties toward the lower group) and every other expert's c is -inf.
      The experts are the top_k of c in rank order, ties toward the lower id.
  3'. Their weights are the unbiased scores s of the chosen experts; renormalized, each is
      divided by ((s_0 + s_1) + ...) + 1e-20 (ascending rank, as transformers adds it); then
      multiplied by routed_scaling. Every operation is an exact IEEE one per element or a
      stable sort, so a token's experts and weights depend on its own logits alone.

Weights (`MoeLayer`): the router is a prepared linear weight [E, H]; the experts are stacked,
gate_up [E, 2I, K'] (rows gate | up) and down [E, H, I'], where slice [e] is exactly the
prepared linear weight `Ops.linear` takes (the backend's `prepare_linear_weight` of the
concatenated rows, so K' is the backend's padded K). One tensor per projection keeps in-place
weight updates a single copy and is the layout a grouped GEMM over experts reads.

Routed expert ids (`Ops.moe(..., routed_experts=buf)`): the op copies each token's experts, in
rank order, into the caller's integer buffer [T, k] (`write_routed_experts`). These are the
ids step 4 ran, taken from the very tensor the experts were grouped by, so they are what the
forward computed, not a second routing; the copy reads that tensor and writes only the
buffer, so the output's bits are the same with or without it. It is a device copy with no
host synchronization, so a captured CUDA graph replays it into the same buffer.

FP8 experts (lockstep/ops/fp8.py's schemes, `MoeLayer.fp8_scheme`): `gate_up_scale` and
`down_scale` sit beside gate_up and down, which hold each expert's part weights as the
backend's `prepare_fp8_linear` gives them (`Fp8Weight.weight`: e4m3 on the GPU, the
dequantized fp32 weight with padded K on the CPU), stacked. The scales:

  "block"    fp32 [E, 2 * ceil(I/128), ceil(H/128)] (gate's block scales, then up's: each
             part keeps the scales its checkpoint tensor had, so a partial last block of I is
             honoured) and [E, ceil(H/128), ceil(I/128)]; activations per token and 128
             columns (Qwen3-30B-A3B-FP8, DeepSeek-V3).
  "channel"  fp32 [E, 2I] and [E, H], one scale per weight row; activations dynamic, one
             scale per token (compressed-tensors FP8_DYNAMIC).
  "tensor"   fp32 [E, 2I] and [E, H], each part's scalar repeated over its rows; activations
             static: `gate_up_input_scale` and `down_input_scale`, one fp32 scale per layer
             and projection, the largest of the experts' checkpoint input scales (ModelOpt
             FP8). One scale for every expert, as a fused dense projection takes the largest
             of its parts' (docs/models.md): the activation is quantized once, whichever
             experts a token chose, and the grouped GEMM reads one quantized copy of x.

A slot's expert GEMM is the backend's FP8 linear at that scheme (`fp8_swiglu_expert`), so its
row equals the dense FP8 linear's row over the same weights and scales; every activation
scale is row-local or static, never taken over the batch. Steps 1-3 and 5 are unchanged (the
router is never quantized).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from lockstep.ops.fp8 import BLOCK, SCHEMES, Fp8Weight

Linear = Callable[[Tensor, Tensor], Tensor]
SiluMul = Callable[[Tensor], Tensor]
ExpertFn = Callable[[Tensor, int], Tensor]  # (rows [M, H], expert id) -> expert output [M, H]


@dataclass(frozen=True)
class DeepseekRouting:
    """DeepSeek's routing parameters (module docstring, steps 2'-3'): `scoring` "sigmoid" or
    "softmax", the fp32 correction bias [E] (None: zero), `groups` and `topk_groups`, the
    `group_score` ("max" or "top2_sum") and the factor the weights are multiplied by."""

    scoring: str
    correction_bias: Tensor | None
    groups: int
    topk_groups: int
    group_score: str
    routed_scaling: float


@dataclass(frozen=True)
class MoeLayer:
    """One sparse layer's router and experts, as `Ops.moe` takes them (module docstring)."""

    router: Tensor  # prepared linear weight [E, H]
    gate_up: Tensor  # [E, 2I, K']: gate_up[e] is expert e's prepared gate | up weight
    down: Tensor  # [E, H, I']: down[e] is expert e's prepared down weight
    top_k: int
    renormalize: bool
    gate_up_scale: Tensor | None = None  # FP8 experts: per `fp8_scheme` (module docstring)
    down_scale: Tensor | None = None
    deepseek: DeepseekRouting | None = None  # DeepSeek routing (steps 2'-3'); None: 2-3
    fp8_scheme: str = "block"  # FP8 experts only (module docstring)
    gate_up_input_scale: Tensor | None = None  # "tensor" FP8 experts: fp32 0-d, static
    down_input_scale: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.gate_up_scale is None) != (self.down_scale is None):
            raise ValueError("FP8 experts need both gate_up_scale and down_scale, or neither")
        if self.fp8_scheme not in SCHEMES:
            raise ValueError(f"FP8 experts' scheme {self.fp8_scheme!r} is invalid: expected "
                             f"one of {SCHEMES}")  # fmt: skip
        static = self.gate_up_input_scale is not None and self.down_input_scale is not None
        if self.fp8 and (self.fp8_scheme == "tensor") != static:
            need = "need" if self.fp8_scheme == "tensor" else "take no"
            raise ValueError(f"{self.fp8_scheme!r} FP8 experts {need} static input scales")

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])

    @property
    def fp8(self) -> bool:
        """Whether the experts are FP8 (module docstring, "FP8 experts")."""
        return self.gate_up_scale is not None


@dataclass(frozen=True)
class Fp8Experts:
    """One stacked FP8 expert projection as the decoder prepares it (`prepare_fp8_experts`):
    weight [E, N, K'] (the backend's `Fp8Weight.weight` of each expert, parts concatenated by
    rows), fp32 scales (the parts' scales concatenated by rows: "block" [E, SB, KB], else
    [E, N]), the scheme and, for "tensor", the static input scale (fp32 0-d)."""

    weight: Tensor
    scale: Tensor
    scheme: str = "block"
    input_scale: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        """Every tensor it holds (for in-place weight updates)."""
        rest = [] if self.input_scale is None else [self.input_scale]
        return [self.weight, self.scale, *rest]


PrepareFp8 = Callable[[str, Tensor, Tensor, "Tensor | None"], Fp8Weight]
Fp8ExpertLinear = Callable[[Tensor, Tensor, str, "Tensor | None"], Tensor]


def prepare_fp8_experts(
    prepare: PrepareFp8, weights: list[Tensor], scales: list[Tensor], experts: int,
    scheme: str = "block", input_scales: list[Tensor] | None = None,
) -> Fp8Experts:  # fmt: skip
    """Stack FP8 expert weights: `weights`, `scales` (and for "tensor" `input_scales`) list
    the experts' part tensors expert-major (gate, up per expert for gate_up; down) in
    canonical form (spec.py): e4m3 [N_p, K], and fp32 [ceil(N_p/128), ceil(K/128)] ("block"),
    [N_p] ("channel") or a scalar ("tensor", repeated over the part's rows). "tensor" takes
    the largest of the input scales (module docstring). Each part goes through the backend's
    `prepare_fp8_linear`, so every backend checks it as it checks a dense FP8 linear, and
    the parts of an expert are concatenated by rows: a part's weight rows keep its scale
    rows."""
    input_scale = None
    if scheme == "tensor":
        if not input_scales:
            raise ValueError("'tensor' FP8 experts need their static input scales")
        input_scale = torch.stack([s.reshape(()).float() for s in input_scales]).amax()
    parts = len(weights) // experts
    stacked_w, stacked_s = [], []
    for e in range(experts):
        prepared = []
        for i in range(e * parts, (e + 1) * parts):
            scale = scales[i]
            if scheme == "tensor":
                scale = scale.reshape(1).expand(weights[i].shape[0]).contiguous()
            prepared.append(prepare(scheme, weights[i], scale, input_scale))
        stacked_w.append(torch.cat([p.weight for p in prepared], dim=0))
        stacked_s.append(torch.cat([p.weight_scale for p in prepared], dim=0))
    weight, scale = torch.stack(stacked_w).contiguous(), torch.stack(stacked_s).contiguous()
    return Fp8Experts(weight, scale, scheme, input_scale)


def fp8_swiglu_expert(
    layer: MoeLayer, expert_linear: Fp8ExpertLinear, silu_mul: SiluMul
) -> ExpertFn:
    """An FP8 expert e on rows [M, H] (module docstring, "FP8 experts"): the backend's FP8
    expert linear at the layer's scheme, gate | up with its input scale, `silu_mul`, then down
    with its own."""
    scheme, up_in, down_in = layer.fp8_scheme, layer.gate_up_input_scale, layer.down_input_scale

    def run(rows: Tensor, e: int) -> Tensor:
        h = silu_mul(expert_linear(rows, layer.gate_up[e], scheme, up_in))
        return expert_linear(h, layer.down[e], scheme, down_in)

    return run


def dequantized_experts(layer: MoeLayer, dtype: torch.dtype) -> MoeLayer:
    """An FP8 layer whose experts hold e4m3 weights, with every expert dequantized
    (fp32(Wq) * sw, `lockstep.ops.fp8.dequantize_weight`, each part with its own scales) and
    cast to `dtype`: the stock backends' experts."""
    assert layer.gate_up_scale is not None and layer.down_scale is not None

    def widen(weight: Tensor, scale: Tensor, parts: int) -> Tensor:
        if layer.fp8_scheme != "block":  # one scale per weight row
            return (weight.to(torch.float32) * scale[:, :, None]).to(dtype)
        out = []
        for w, s in expert_parts_stacked(weight, scale, parts):
            e, n, k = w.shape
            sw = s.repeat_interleave(BLOCK, 1)[:, :n].repeat_interleave(BLOCK, 2)[:, :, :k]
            out.append((w.to(torch.float32) * sw).to(dtype))
        return torch.cat(out, dim=1)

    gate_up = widen(layer.gate_up, layer.gate_up_scale, 2)
    down = widen(layer.down, layer.down_scale, 1)
    return MoeLayer(layer.router, gate_up, down, layer.top_k, layer.renormalize)


def expert_parts_stacked(weight: Tensor, scale: Tensor, parts: int) -> list[tuple[Tensor, Tensor]]:
    """`expert_parts` for every expert at once: [E, N, K] and [E, SB, KB] (or per-row [E, N])
    -> the parts' [E, N/parts, K] and [E, SB/parts, KB] (or [E, N/parts])."""
    n, sb = weight.shape[1] // parts, scale.shape[1] // parts
    return [(weight[:, i * n : (i + 1) * n], scale[:, i * sb : (i + 1) * sb]) for i in range(parts)]


def expert_parts(weight: Tensor, scale: Tensor, parts: int) -> list[tuple[Tensor, Tensor]]:
    """One expert's stacked weight [N, K] and scales ([SB, KB] block, [N] per row; `Fp8Experts`,
    slice e) split back into its `parts` checkpoint tensors (gate | up: 2; down: 1), each with
    its own scales."""
    return [(w[0], s[0]) for w, s in expert_parts_stacked(weight[None], scale[None], parts)]


def prepare_expert_weights(prepare: Callable[[Tensor], Tensor], stacked: Tensor) -> Tensor:
    """[E, N, K] -> [E, N, K']: every expert's weight prepared by the backend's
    `prepare_linear_weight`, stacked. It is applied once to the [E*N, K] rows, which is the
    same as per expert because every backend prepares a weight row by row (pads K, converts)."""
    e, n, _ = stacked.shape
    return prepare(stacked.reshape(e * n, -1).contiguous()).view(e, n, -1)


def write_routed_experts(routed_experts: Tensor | None, experts: Tensor) -> None:
    """Copy the experts a layer routed by (int64 [T, k], rank order) into the caller's
    buffer (module docstring, "Routed expert ids"); None: nothing asked. The buffer's
    integer dtype must hold every id (int16 up to 32767 experts)."""
    if routed_experts is None:
        return
    if routed_experts.shape != experts.shape:
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)}; expected "
            f"{tuple(experts.shape)} (tokens, top_k)"
        )
    routed_experts.copy_(experts)


class Routing(NamedTuple):
    """Each token's experts in rank order and their weights."""

    experts: Tensor  # int64 [T, k]
    weights: Tensor  # float32 [T, k]


def route_sorted(logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """Routing (contract steps 2-3) from torch operations that are exact per element or
    documented stable: a stable descending sort (equal logits keep ascending ids), exp per
    element, and sums written out as fixed sequences of elementwise adds: over the k in
    ascending rank, or over all E by a pairwise tree (E zero-padded to a power of two; level
    by level, column c adds column c + width/2). No host synchronization (CUDA-graph safe).
    Not for the CPU, whose vectorized exp may round its tail elements differently."""
    logits = logits.float()
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    top = values[:, :top_k]
    e = torch.exp(top - top[:, :1])
    if renormalize:
        total = e[:, 0]
        for r in range(1, top_k):
            total = total + e[:, r]
    else:
        terms = torch.exp(logits - top[:, :1])
        width = 1 << (terms.shape[1] - 1).bit_length()
        terms = torch.nn.functional.pad(terms, (0, width - terms.shape[1]))
        while width > 1:
            width //= 2
            terms = terms[:, :width] + terms[:, width:]
        total = terms[:, 0]
    return Routing(ids[:, :top_k].contiguous(), e / total[:, None])


def route_deepseek(scores: Tensor, top_k: int, renormalize: bool, r: DeepseekRouting) -> Routing:
    """Steps 2'-3' (module docstring) from the per-element scores s [T, E] (fp32, computed by
    the caller's own sigmoid or softmax kernel), in torch operations that are exact per element
    (add, multiply, divide, max, masking, gather) or stable sorts: no summation order or
    vectorized transcendental function can move a bit. Selection ties go to the lower id."""
    scores = scores.float()
    choice = scores if r.correction_bias is None else scores + r.correction_bias.float()
    t, e = choice.shape
    if r.groups > 1:
        grouped = choice.view(t, r.groups, e // r.groups)
        if r.group_score == "max":
            group = grouped.amax(dim=-1)
        else:
            best = torch.sort(grouped, dim=-1, descending=True, stable=True).values
            group = best[..., 0] + best[..., 1]
        kept = torch.sort(group, dim=-1, descending=True, stable=True).indices[:, : r.topk_groups]
        mask = torch.zeros(t, r.groups, dtype=torch.bool, device=choice.device)
        mask.scatter_(1, kept, True)
        mask = mask.repeat_interleave(e // r.groups, dim=1)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights[:, 0]
        for rank in range(1, top_k):
            total = total + weights[:, rank]
        weights = weights / (total + 1e-20)[:, None]
    if r.routed_scaling != 1.0:
        weights = weights * r.routed_scaling
    return Routing(ids, weights)


def stock_route_deepseek(
    logits: Tensor, top_k: int, renormalize: bool, r: DeepseekRouting
) -> Routing:
    """DeepSeek routing as transformers writes it (DeepseekV3TopkRouter, DeepseekV2TopkRouter):
    torch's sigmoid or softmax, `torch.topk` for groups and experts (whose order among equal
    values is unspecified), a torch sum for the renormalization. The stock backends' routing."""
    logits = logits.float()
    scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if r.correction_bias is None else scores + r.correction_bias.float()
    t, e = choice.shape
    if r.groups > 1:
        grouped = choice.view(t, r.groups, e // r.groups)
        if r.group_score == "max":
            group = grouped.max(dim=-1).values
        else:
            group = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.topk(group, k=r.topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group).scatter_(1, kept, 1).bool()
        choice = choice.masked_fill(~mask.repeat_interleave(e // r.groups, dim=1), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(ids, weights * r.routed_scaling)


def swiglu_expert(layer: MoeLayer, linear: Linear, silu_mul: SiluMul) -> ExpertFn:
    """Expert e on rows [M, H]: linear(silu_mul(linear(rows, gate_up[e])), down[e])."""
    return lambda rows, e: linear(silu_mul(linear(rows, layer.gate_up[e])), layer.down[e])


def experts_grouped(
    x: Tensor, experts: Tensor, layer: MoeLayer, linear: Linear, silu_mul: SiluMul,
    expert: ExpertFn | None = None,
) -> Tensor:  # fmt: skip
    """Every (token, rank) slot's expert output [T, k, H] (contract step 4), each expert run
    once on the rows routed to it: `expert` (default `swiglu_expert` of `linear` and
    `silu_mul`). Reads the per-expert counts on the host."""
    run = expert or swiglu_expert(layer, linear, silu_mul)
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending within
    counts = torch.bincount(flat, minlength=layer.num_experts).tolist()
    out = torch.empty(t * k, layer.down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        rows = x.index_select(0, torch.div(slots, k, rounding_mode="floor"))
        y = run(rows, e)
        out.index_copy_(0, slots, y.to(out.dtype))
    return out.view(t, k, -1)


def experts_dense(
    x: Tensor, experts: Tensor, layer: MoeLayer, linear: Linear, silu_mul: SiluMul,
    expert: ExpertFn | None = None,
) -> Tensor:  # fmt: skip
    """The same slots as `experts_grouped`, computed by running every expert on every row and
    keeping the rows routed to it: E/k times the arithmetic, but no host synchronization, so
    a CUDA graph can hold it. A slot's bits equal `experts_grouped`'s wherever `linear` is
    M-invariant (other rows in the call change nothing). `expert` as in `experts_grouped`."""
    run = expert or swiglu_expert(layer, linear, silu_mul)
    t, k = experts.shape
    out = torch.zeros(t, k, layer.down.shape[1], dtype=x.dtype, device=x.device)
    for e in range(layer.num_experts):
        y = run(x, e).to(out.dtype)
        out = torch.where((experts == e)[:, :, None], y[:, None, :], out)
    return out


def combine_in_rank_order(slots: Tensor, weights: Tensor) -> Tensor:
    """out [T, H] fp32 = w_0 y_0 + w_1 y_1 + ..., one product and one add per element and
    rank, in ascending rank (contract step 5). slots [T, k, H], weights [T, k]."""
    slots, weights = slots.float(), weights.float()
    out = slots[:, 0] * weights[:, 0:1]
    for r in range(1, slots.shape[1]):
        out = out + slots[:, r] * weights[:, r : r + 1]
    return out
